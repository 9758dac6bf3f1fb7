"""Prometheus adapter: turns per-step stats and finished requests' timestamps into DESIGN §3 metrics.

The engine never imports prometheus_client; it hands this adapter plain dataclasses
(`StepStats` per step, `RequestRecord` per finished request). The registry is injectable so
tests use a fresh `CollectorRegistry()`. Latency metrics carry `priority_class`; tenant labels
are bounded to the configured `tenant_labels` (plus `default`), everything else is `other`.

With `compat="vllm"` the registry also exports a vLLM-named view (`vllm:*`, label `model_name`) of
the same series, built at scrape time from them (`_VllmView`), so a step pays nothing for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "magnitude_"
# Up to two hours, as vLLM's are: long generations must not all land in +Inf. New bounds only add
# buckets; the chart's TTFT SLO bound must stay one of them (tests/operator/test_chart.py).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
                   600.0, 1200.0, 1800.0, 3600.0, 7200.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000, 200_000)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
OCCUPANCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
METRICS_COMPAT = ("none", "vllm")
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
# Tokens a drafted decode gains per target step: 1 (all drafts rejected) .. numSpeculativeTokens + 1.
SPEC_TOKEN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


class StepStatsLike(Protocol):
    duration_s: float
    running: int
    waiting: int
    swapped: int
    kv_used_blocks: int
    kv_total_blocks: int
    kv_cached_blocks: int
    swap_used_blocks: int
    swap_total_blocks: int
    num_seqs: int
    num_tokens: int
    token_budget: int
    max_sequences: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_alloc_failures: int
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

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        tenant_labels: Iterable[str] = (),
        *,
        service_version: str = "",
        compat: str = "none",
    ) -> None:
        if compat not in METRICS_COMPAT:
            raise ValueError(f"metrics compat {compat!r}: one of {', '.join(METRICS_COMPAT)}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self._tenants = set(tenant_labels) | {"default"}
        self.service_version = service_version
        self.compat = compat
        self.model_name = ""  # set with model_info; the vLLM view's `model_name`
        # Last cumulative scheduler counters seen, so each step adds only its difference.
        self._prefix_queries = self._prefix_hits = self._alloc_failures = 0
        r = self.registry
        g = lambda name, doc, labels=(): Gauge(PREFIX + name, doc, labels, registry=r)  # noqa: E731
        self.requests_running = g("requests_running", "Sequences resident in the running set.")
        self.requests_waiting = g("requests_waiting", "Requests admitted to the queue, not yet running.")
        self.requests_swapped = g("requests_swapped", "Preempted sequences whose KV lives in host memory.")
        self.kv_cache_usage_ratio = g("kv_cache_usage_ratio", "Share of device KV blocks in use (0..1).")
        self.kv_cache_blocks = g("kv_cache_blocks", "Device KV blocks in the pool.")
        self.kv_cache_blocks_used = g("kv_cache_blocks_used", "Device KV blocks referenced by requests.")
        self.kv_cache_blocks_cached = g(
            "kv_cache_blocks_cached", "Unreferenced device KV blocks still holding a reusable prefix (evictable).")
        self.kv_cache_swap_blocks = g("kv_cache_swap_blocks", "Host swap KV blocks in the pool.")
        self.kv_cache_swap_blocks_used = g("kv_cache_swap_blocks_used", "Host swap KV blocks holding preempted requests.")
        self.admission_shedding = g("admission_shedding", "1 while load shedding rejects the lowest classes.")
        self.shed_classes = g("admission_shed_classes", "Number of priority classes currently shed.")
        self.shed_class = g("admission_shed_class", "1 for each priority class admission sheds now, 0 once it stops.",
                            ("priority_class",))
        self._ever_shed: set[str] = set()
        self.engine_ready = g("engine_ready", "1 when the model is loaded and the engine loop runs.")
        self.model_load_seconds = g("model_load_seconds", "Seconds the model took to load at startup.")
        # What the scheduler runs with; source: set (the config's), derived (from the measured cost
        # model and the ITL target), static (null with no cost model: the fixed defaults).
        self.scheduler_token_budget = g("scheduler_token_budget", "Most tokens one step computes.", ("source",))
        self.scheduler_prefill_chunk = g("scheduler_prefill_chunk_tokens", "Most prompt tokens one sequence "
                                         "computes in one step.", ("source",))
        self.scheduler_itl_target = g("scheduler_itl_target_seconds", "The ITL target each step's predicted time "
                                      "stays within while requests decode (absent: no per-step bound).", ("source",))
        self.model_info = g("model_info", "1 for the loaded model; labels say what it is and how it runs.",
                            ("model", "device", "dtype", "quantization", "service_version"))
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
        self.batch_token_occupancy = h("batch_token_occupancy", "Per step: scheduled tokens / token budget.",
                                       OCCUPANCY_BUCKETS, labels=())
        self.batch_sequence_occupancy = h("batch_sequence_occupancy", "Per step: sequences in the batch / maxSequences.",
                                          OCCUPANCY_BUCKETS, labels=())

        c = lambda name, doc, labels: Counter(PREFIX + name, doc, labels, registry=r)  # noqa: E731
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of requests that reached their first token.", lat)
        self.generation_tokens = c("generation_tokens", "Output tokens generated.", lat)
        self.preemptions = c("preemptions", "Preempted sequences.", ("mode", "reason"))
        self.rejections = c("rejections", "Requests rejected at or after admission.", ("reason", "priority_class"))
        self.requests_finished = c("requests_finished", "Requests that ended, by status.", ("status", "priority_class", "tenant"))
        self.prefix_cache_queries = c("prefix_cache_queries", "Prefix-cache lookups (one per fresh prefill).", ())
        self.prefix_cache_hits = c("prefix_cache_hits", "Prefix-cache lookups that reused at least one block.", ())
        self.kv_alloc_failures = c("kv_cache_allocation_failures",
                                   "KV block allocations the pool could not satisfy (the request waited or another was preempted).", ())
        self.output_contract = c("output_contract",
                                 "Answers that carried a contract (JSON schema, tool schema), by the server's check: "
                                 "valid, invalid, or unverified (cut short before it could be checked).", ("result",))
        for result in ("valid", "invalid", "unverified"):
            self.output_contract.labels(result)  # every series from the start: rate() needs no first event
        self.itl_gaps = c("scheduler_itl_gaps",
                          "Gaps between back-to-back decoding steps (one step's start to the next's: what running "
                          "streams waited for their next token) judged against the ITL target the first step was "
                          "planned under: within it, or over it (a broken per-step promise).", ("result",))
        for result in ("within", "over"):
            self.itl_gaps.labels(result)
        spec = ("priority_class", "method")
        self.spec_draft_tokens = c("spec_decode_draft_tokens", "Speculative draft tokens proposed.", spec)
        self.spec_accepted_tokens = c("spec_decode_accepted_tokens",
                                      "Speculative draft tokens that verification accepted.", spec)
        self.spec_enabled = Gauge(PREFIX + "spec_decode_enabled",
                                  "1 while drafts are proposed by this method (auto mode switches it), else 0.",
                                  ("method",), registry=r)
        self.spec_tokens_per_step = h(
            "spec_decode_tokens_per_step",
            "Per decode that carried drafts: tokens it gained in that target step (1 + accepted drafts); "
            "_count is the number of drafted decodes, _sum / _count the mean tokens per target step.",
            SPEC_TOKEN_BUCKETS, labels=spec)
        self.spec_time_saved = c(
            "spec_decode_time_saved_seconds",
            "Estimated decode time drafting saved: per drafted decode step, the tokens per sequence times the "
            "measured plain step time, minus the step's time, where positive.", ("method",))
        self.spec_time_lost = c(
            "spec_decode_time_lost_seconds",
            "The same estimate where negative (a drafted step that cost more than the plain steps it replaced): "
            "net saving = time_saved - time_lost.", ("method",))
        if compat == "vllm":
            self.registry.register(_VllmView(self))

    def tenant_label(self, tenant: str) -> str:
        return tenant if tenant in self._tenants else "other"

    def labels(self, priority_class: str, tenant: str) -> tuple[str, str]:
        return priority_class, self.tenant_label(tenant)

    # -- per step ---------------------------------------------------------------------------
    def observe_step(self, stats: StepStatsLike) -> None:
        """A step that ran a batch: its duration, occupancy, preemptions, and the state it left."""
        self.step_duration.observe(stats.duration_s)
        if stats.token_budget:
            self.batch_token_occupancy.observe(stats.num_tokens / stats.token_budget)
        if stats.max_sequences:
            self.batch_sequence_occupancy.observe(stats.num_seqs / stats.max_sequences)
        self.set_gauges(stats)
        for _, mode, reason in stats.preempted:
            self.preemptions.labels(mode, reason).inc()

    def set_gauges(self, stats: StepStatsLike) -> None:
        self.requests_running.set(stats.running)
        self.requests_waiting.set(stats.waiting)
        self.requests_swapped.set(stats.swapped)
        self.kv_cache_blocks.set(stats.kv_total_blocks)
        self.kv_cache_blocks_used.set(stats.kv_used_blocks)
        self.kv_cache_blocks_cached.set(stats.kv_cached_blocks)
        self.kv_cache_swap_blocks.set(stats.swap_total_blocks)
        self.kv_cache_swap_blocks_used.set(stats.swap_used_blocks)
        self.kv_cache_usage_ratio.set(stats.kv_used_blocks / stats.kv_total_blocks if stats.kv_total_blocks else 0.0)
        # The scheduler counts cumulatively; counters take the difference (admission checks between
        # steps are picked up by the next call).
        if stats.prefix_cache_queries > self._prefix_queries:
            self.prefix_cache_queries.inc(stats.prefix_cache_queries - self._prefix_queries)
            self._prefix_queries = stats.prefix_cache_queries
        if stats.prefix_cache_hits > self._prefix_hits:
            self.prefix_cache_hits.inc(stats.prefix_cache_hits - self._prefix_hits)
            self._prefix_hits = stats.prefix_cache_hits
        if stats.kv_alloc_failures > self._alloc_failures:
            self.kv_alloc_failures.inc(stats.kv_alloc_failures - self._alloc_failures)
            self._alloc_failures = stats.kv_alloc_failures

    def observe_tokens(self, priority_class: str, tenant: str, n: int) -> None:
        if n:
            self.generation_tokens.labels(*self.labels(priority_class, tenant)).inc(n)

    # -- per request ------------------------------------------------------------------------
    def on_output_contract(self, result: str) -> None:
        self.output_contract.labels(result).inc()

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
    def observe_itl_gap(self, gap_s: float, target_s: float) -> None:
        """A decoding step's gap to the next one, against the ITL target it was planned under."""
        self.itl_gaps.labels("over" if gap_s > target_s else "within").inc()

    def set_scheduler_limits(self, token_budget: int, prefill_chunk: int, itl_target_ms: float | None,
                             source: str) -> None:
        self.scheduler_token_budget.labels(source).set(token_budget)
        self.scheduler_prefill_chunk.labels(source).set(prefill_chunk)
        if itl_target_ms is not None:
            self.scheduler_itl_target.labels(source).set(itl_target_ms / 1000.0)

    def set_model_info(self, model: str, device: str, dtype: str, quantization: str) -> None:
        self.model_name = model
        self.model_info.labels(model, device, dtype, quantization, self.service_version or "none").set(1)

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

    def observe_speculation(self, priority_class: str, method: str, proposed: int, accepted: int) -> None:
        self.spec_draft_tokens.labels(priority_class, method).inc(proposed)
        self.spec_accepted_tokens.labels(priority_class, method).inc(accepted)

    def set_speculation_enabled(self, method: str, enabled: bool) -> None:
        self.spec_enabled.labels(method).set(1 if enabled else 0)
        self.spec_time_saved.labels(method)  # the series exist from the start: rate() needs no first event
        self.spec_time_lost.labels(method)

    def observe_spec_step(self, priority_class: str, method: str, tokens: int) -> None:
        """One decode that carried drafts gained `tokens` in its target step."""
        self.spec_tokens_per_step.labels(priority_class, method).observe(tokens)

    def observe_time_saved(self, method: str, seconds: float) -> None:
        (self.spec_time_saved if seconds >= 0 else self.spec_time_lost).labels(method).inc(abs(seconds))

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


# vLLM's name -> (our series, type). Only series whose meaning is the same as vLLM's: a consumer of the
# vLLM name must be able to trust it (prefix-cache counters are not here: vLLM counts tokens, we count
# lookups). Counters and histograms are summed over priority_class and tenant.
VLLM_SERIES: dict[str, tuple[str, str]] = {
    "vllm:num_requests_running": ("requests_running", "gauge"),
    "vllm:num_requests_waiting": ("requests_waiting", "gauge"),
    "vllm:num_requests_swapped": ("requests_swapped", "gauge"),
    "vllm:kv_cache_usage_perc": ("kv_cache_usage_ratio", "gauge"),
    # The name before vLLM 0.10; the Inference Extension's endpoint picker defaulted to it until v0.5.
    "vllm:gpu_cache_usage_perc": ("kv_cache_usage_ratio", "gauge"),
    "vllm:prompt_tokens": ("prompt_tokens", "counter"),
    "vllm:generation_tokens": ("generation_tokens", "counter"),
    "vllm:num_preemptions": ("preemptions", "counter"),
    "vllm:time_to_first_token_seconds": ("ttft", "histogram"),
    "vllm:e2e_request_latency_seconds": ("e2e", "histogram"),
    "vllm:inter_token_latency_seconds": ("itl", "histogram"),
    "vllm:request_queue_time_seconds": ("queue_time", "histogram"),
    "vllm:request_prefill_time_seconds": ("prefill_time", "histogram"),
    "vllm:request_prompt_tokens": ("prompt_length", "histogram"),
    "vllm:request_generation_tokens": ("output_length", "histogram"),
}  # vLLM's name -> (the EngineMetrics attribute it reads, type)


def vllm_metric_names() -> set[str]:
    """Every sample name the vLLM view exports (counters with `_total`, histograms' parts)."""
    out: set[str] = set()
    for name, (_, typ) in VLLM_SERIES.items():
        if typ == "counter":
            out.add(name + "_total")
        elif typ == "histogram":
            out |= {name + "_bucket", name + "_sum", name + "_count"}
        else:
            out.add(name)
    return out


class _VllmView:
    """`--metrics-compat vllm`: the `vllm:*` names of VLLM_SERIES, read from our series at scrape time."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # built at scrape time: nothing to check for name clashes at registration

    def collect(self) -> Iterator[Metric]:
        model = self._metrics.model_name
        if not model:
            return  # before the model loads there is no model_name to label with
        for vname, (attr, typ) in VLLM_SERIES.items():
            families = list(getattr(self._metrics, attr).collect())
            if not families:
                continue
            family = families[0]
            out = Metric(vname, f"vLLM-compatible view of {family.name}.", typ)
            totals: dict[tuple[str, str], float] = {}
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                suffix = sample.name[len(family.name):]
                le = sample.labels.get("le", "")
                totals[(suffix, le)] = totals.get((suffix, le), 0.0) + sample.value
            if not totals and typ == "counter":
                totals[("_total", "")] = 0.0
            for (suffix, le), value in totals.items():
                labels = {"model_name": model, **({"le": le} if le else {})}
                out.add_sample(vname + suffix, labels, value)
            yield out
