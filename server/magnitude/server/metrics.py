"""Prometheus adapter: turns per-step stats and finished requests' timestamps into DESIGN §3 metrics.

The engine never imports prometheus_client; it hands this adapter plain dataclasses
(`StepStats` per step, `RequestRecord` per finished request). The registry is injectable so
tests use a fresh `CollectorRegistry()`. Latency metrics carry `priority_class`; tenant labels
are bounded to the configured `tenant_labels` (plus `default`), everything else is `other`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "magnitude_"
# Up to two hours, as vLLM's are: long generations must not all land in +Inf. New bounds only add
# buckets; the chart's TTFT SLO bound must stay one of them (tests/operator/test_chart.py).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
                   600.0, 1200.0, 1800.0, 3600.0, 7200.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000, 200_000)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class StepStatsLike(Protocol):
    duration_s: float
    running: int
    waiting: int
    swapped: int
    kv_used_blocks: int
    kv_total_blocks: int
    preempted: list[tuple[str, str, str]]


@dataclass(slots=True)
class RequestRecord:
    """One request's outcome and timestamps (seconds on one monotonic clock); None = not reached."""

    priority_class: str
    tenant: str
    status: str  # finished | cancelled | timed_out | rejected | failed
    arrival: float
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    # From the request's timeline (None = phase not reached).
    preparation_s: float | None = None
    prefill_s: float | None = None


class EngineMetrics:
    """All `magnitude_*` series of DESIGN §3, registered on `registry`."""

    def __init__(self, registry: CollectorRegistry | None = None, tenant_labels: Iterable[str] = ()) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._tenants = set(tenant_labels) | {"default"}
        r = self.registry
        g = lambda name, doc, labels=(): Gauge(PREFIX + name, doc, labels, registry=r)  # noqa: E731
        self.requests_running = g("requests_running", "Sequences resident in the running set.")
        self.requests_waiting = g("requests_waiting", "Requests admitted to the queue, not yet running.")
        self.requests_swapped = g("requests_swapped", "Preempted sequences whose KV lives in host memory.")
        self.kv_cache_usage_ratio = g("kv_cache_usage_ratio", "Share of device KV blocks in use (0..1).")
        self.kv_cache_blocks_total = g("kv_cache_blocks_total", "Device KV blocks in the pool.")
        self.admission_shedding = g("admission_shedding", "1 while load shedding rejects the lowest classes.")
        self.shed_classes = g("admission_shed_classes", "Number of priority classes currently shed.")
        self.shed_class = g("admission_shed_class", "1 for each priority class admission sheds now, 0 once it stops.",
                            ("priority_class",))
        self._ever_shed: set[str] = set()
        self.engine_ready = g("engine_ready", "1 when the model is loaded and the engine loop runs.")
        self.model_load_seconds = g("model_load_seconds", "Seconds the model took to load at startup.")
        self.model_info = g("model_info", "1 for the loaded model; labels say what it is and how it runs.",
                            ("model", "device", "dtype", "quantization"))
        q = ("model", "method")
        self.quantization_top1_agreement = g(
            "quantization_top1_agreement", "Quantized weights' top-1 agreement with the unquantized model (0..1).", q)
        self.quantization_mean_kl = g(
            "quantization_mean_kl", "Quantized weights' mean KL divergence from the unquantized model (nats/token).", q)
        self.quantization_passed = g(
            "quantization_passed", "1 when the quantization evaluation record met its thresholds, else 0.", q)

        lat = ("priority_class", "tenant")
        h = lambda name, doc, buckets, labels=lat: Histogram(  # noqa: E731
            PREFIX + name, doc, labels, buckets=buckets, registry=r
        )
        self.queue_time = h("queue_time_seconds", "Admission into a step minus arrival.", LATENCY_BUCKETS)
        self.ttft = h("time_to_first_token_seconds", "First output token minus arrival.", LATENCY_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Gap between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Finish minus arrival.", LATENCY_BUCKETS)
        self.step_duration = h("step_duration_seconds", "Wall time of one engine step.", STEP_BUCKETS, labels=())
        self.preparation_time = h("request_preparation_seconds",
                                  "Arrival to admission check: validation, chat template, tokenization.", LATENCY_BUCKETS)
        self.prefill_time = h("request_prefill_seconds", "First admission to first token, preempted time excluded.",
                              LATENCY_BUCKETS)
        self.prompt_length = h("request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.output_length = h("request_generation_tokens", "Output tokens per finished request.", TOKEN_BUCKETS)

        c = lambda name, doc, labels: Counter(PREFIX + name, doc, labels, registry=r)  # noqa: E731
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of requests that reached their first token.", lat)
        self.generation_tokens = c("generation_tokens", "Output tokens generated.", lat)
        self.preemptions = c("preemptions", "Preempted sequences.", ("mode", "reason"))
        self.rejections = c("rejections", "Requests rejected at or after admission.", ("reason", "priority_class"))
        self.requests_finished = c("requests_finished", "Requests that ended, by status.", ("status", "priority_class", "tenant"))

    def tenant_label(self, tenant: str) -> str:
        return tenant if tenant in self._tenants else "other"

    def labels(self, priority_class: str, tenant: str) -> tuple[str, str]:
        return priority_class, self.tenant_label(tenant)

    # -- per step ---------------------------------------------------------------------------
    def observe_step(self, stats: StepStatsLike) -> None:
        self.step_duration.observe(stats.duration_s)
        self.set_gauges(stats)
        for _, mode, reason in stats.preempted:
            self.preemptions.labels(mode, reason).inc()

    def set_gauges(self, stats: StepStatsLike) -> None:
        self.requests_running.set(stats.running)
        self.requests_waiting.set(stats.waiting)
        self.requests_swapped.set(stats.swapped)
        self.kv_cache_blocks_total.set(stats.kv_total_blocks)
        self.kv_cache_usage_ratio.set(stats.kv_used_blocks / stats.kv_total_blocks if stats.kv_total_blocks else 0.0)

    def observe_tokens(self, priority_class: str, tenant: str, n: int) -> None:
        if n:
            self.generation_tokens.labels(*self.labels(priority_class, tenant)).inc(n)

    # -- per request ------------------------------------------------------------------------
    def observe_rejection(self, reason: str, priority_class: str) -> None:
        # Reasons may carry detail after ':' ("too_long:5000>4096"); the label keeps the bounded kind.
        self.rejections.labels(reason.split(":", 1)[0], priority_class).inc()

    def observe_queue_time(self, priority_class: str, tenant: str, seconds: float) -> None:
        """Called once per request, when it is first scheduled: the autoscaler's signal must not wait
        for the request to finish (stuck requests would never show)."""
        self.queue_time.labels(*self.labels(priority_class, tenant)).observe(max(0.0, seconds))

    def observe_request(self, rec: RequestRecord) -> None:
        """Called once when a request reaches a terminal state (queue time is observed at admission)."""
        labels = self.labels(rec.priority_class, rec.tenant)
        self.requests_finished.labels(rec.status, *labels).inc()
        if rec.first_token is not None:
            self.ttft.labels(*labels).observe(max(0.0, rec.first_token - rec.arrival))
            self.prompt_tokens.labels(*labels).inc(rec.prompt_tokens)
        itl = self.itl.labels(*labels)
        for a, b in zip(rec.token_times, rec.token_times[1:]):
            itl.observe(max(0.0, b - a))
        if rec.finished is not None and rec.status == "finished":
            self.e2e.labels(*labels).observe(max(0.0, rec.finished - rec.arrival))
            self.prompt_length.labels(*labels).observe(rec.prompt_tokens)
            self.output_length.labels(*labels).observe(rec.output_tokens)
        if rec.preparation_s is not None:
            self.preparation_time.labels(*labels).observe(max(0.0, rec.preparation_s))
        if rec.prefill_s is not None and rec.first_token is not None:
            self.prefill_time.labels(*labels).observe(max(0.0, rec.prefill_s))

    def register_decisions(self, counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        """`magnitude_decisions_total{kind,reason}`, read from the request log at scrape time (its
        reasons are already bounded), so a step pays nothing for it."""
        self.registry.register(_DecisionCounts(counts))

    # -- state ------------------------------------------------------------------------------
    def set_model_info(self, model: str, device: str, dtype: str, quantization: str) -> None:
        self.model_info.labels(model, device, dtype, quantization).set(1)

    def set_quantization_record(self, model: str, summary: dict) -> None:
        labels = (model, summary["method"])
        self.quantization_top1_agreement.labels(*labels).set(summary["top1_agreement"])
        self.quantization_mean_kl.labels(*labels).set(summary["mean_kl"])
        self.quantization_passed.labels(*labels).set(1 if summary["passed"] else 0)

    def set_shedding(self, shed_classes: Iterable[str]) -> None:
        shed = set(shed_classes)
        self.admission_shedding.set(1 if shed else 0)
        self.shed_classes.set(len(shed))
        # The family is exported from the start (empty = nothing shed), so a reader can tell "no
        # class shed" from "an engine without this series".
        self._ever_shed |= shed
        for cls in self._ever_shed:  # classes shed before and not now go to 0
            self.shed_class.labels(cls).set(1 if cls in shed else 0)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _DecisionCounts:
    """A collector over the decision log's counts (a counter family built at scrape time)."""

    def __init__(self, counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._counts = counts

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(PREFIX + "decisions", "Scheduler decisions by kind and reason.", labels=("kind", "reason"))]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(PREFIX + "decisions", "Scheduler decisions by kind and reason.", labels=("kind", "reason"))
        for (kind, reason), n in sorted(self._counts().items()):
            family.add_metric((kind, reason), n)
        yield family
