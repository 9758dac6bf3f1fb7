"""The asyncio-facing engine: load the runner, admit requests, stream their events, abort them.

`AsyncEngine.submit()` (event-loop thread) builds an engine `Request`, runs admission
synchronously (so the HTTP layer can answer 429 at once) and returns a `RequestStream` whose
async iterator yields `Progress`, `Delta`, then exactly one terminal `Finished` or `Failed`.
The engine-loop thread produces those events in `after_step` (under the loop's lock) and hands
them to the asyncio side with `call_soon_threadsafe`. Loading runs in its own thread and reports
phases (resolving, converting, loading_weights, warming_up) for `/readyz` and `loading` chunks.
What happened to each request (timeline, timing, the decision log) is kept by `timeline.RequestLog`,
which this class feeds and the HTTP layer reads.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol

from magnitude.engine.output import RunnerOutput, StepPlan
from magnitude.engine.quantization import judge, summary
from magnitude.engine.sampling import SamplingParams
from magnitude.engine.speculation import SpeculationPolicy
from magnitude.policy.schema import EngineConfig
from magnitude.server.body_limit import context_body_bytes
from magnitude.server.engine_loop import EngineLoop, StepStats, stats_of
from magnitude.server.metrics import EngineMetrics, RequestRecord
from magnitude.server.output_processor import OutputState, TokenLogprob
from magnitude.server.protocol import internal_error_message
from magnitude.server.timeline import RequestLog
from magnitude.server.tokenization import PromptRenderer
from magnitude.server.trace_recorder import Ended, TraceRecorder
from magnitude.sim.cost import SERVED_COLD_MARGIN, SchedulerLimits, apply_limits, cost_model_from_document
from magnitude.sim.served_limits import LimitsChange, LimitsFollower

log = logging.getLogger("magnitude.async_engine")

ProgressFn = Callable[[str, float], None]
# A forward pass this long is hung, not slow: a 512-token prefill takes about a second on two CPU cores.
DEFAULT_STALL_TIMEOUT_S = 300.0
TERMINAL_EVENT_KINDS = {"finish": "finished", "cancel": "cancelled", "timeout": "timed_out", "reject": "rejected"}


class Runner(Protocol):
    tokenizer: Any
    eos_token_ids: list[int]
    max_model_len: int
    model_name: str
    num_blocks: int
    num_swap_blocks: int

    def execute(self, plan: StepPlan) -> RunnerOutput: ...


# -- events a RequestStream yields ---------------------------------------------------------------
@dataclass(slots=True)
class Progress:
    phase: str  # loading | preparing | queued | prefill | generating
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, **self.detail}


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class Finished:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timing: dict[str, float | int | None]


@dataclass(slots=True)
class Failed:
    status: int
    message: str
    code: str


Event = Progress | Delta | Finished | Failed


class NotReady(Exception):
    """503: still loading, shutting down, or the engine died."""

    def __init__(self, phase: str, message: str) -> None:
        super().__init__(message)
        self.phase = phase


def freeze_loaded_heap() -> None:
    """Move every object loading made into the garbage collector's permanent generation.

    Loading leaves ~445,000 long-lived Python objects (torch, transformers, the model's modules, the
    tokenizer; SmolLM2 w4a16) that a full collection scans every time the oldest generation comes
    due: 230 ms on two EPYC cores, with the GIL held, so every stream stalls for it. Frozen (after
    one last collection, so no garbage is kept), collections scan only what serving allocates
    (`gc.freeze`; vLLM freezes its engine's heap after start-up too). For the serving process only:
    a process that loads engines again and again (the tests) would keep each frozen heap's cycles."""
    gc.collect()
    gc.freeze()
    log.info("froze the %d objects loading left: the garbage collector no longer scans them", gc.get_freeze_count())


class Rejected(Exception):
    """429: admission refused the request."""

    def __init__(self, reason: str, retry_after_s: float | None) -> None:
        super().__init__(f"request rejected by admission: {reason}")
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class RequestSpec:
    """What the HTTP layer hands the engine for one request (already validated)."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority_class: str
    tenant: str = "default"
    deadline_ms: float | None = None
    include_progress: bool = False
    arrival: float | None = None  # engine clock when the HTTP request arrived; None: at submit
    loading_s: float = 0.0  # of which spent waiting for the model to load
    client_request_id: str | None = None  # the client's X-Request-Id: the timeline is findable by it


class RequestStream:
    def __init__(self, request_id: str, engine: "AsyncEngine") -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[list[Event]] = asyncio.Queue()
        self.done = False

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self.done:
            for ev in await self._queue.get():
                yield ev
                if isinstance(ev, (Finished, Failed)):
                    self.done = True
                    return

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self._engine.abort(self.request_id)


@dataclass
class _Tracked:
    """Loop-thread-side state of one live request."""

    request: Any
    spec: RequestSpec
    stream: RequestStream
    out: OutputState
    last_position: int | None = None
    last_prefill: int = -1
    generating_sent: bool = False
    done: bool = False
    events: list[Event] = field(default_factory=list)


def new_request_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def _status_name(status: Any) -> str:
    name = getattr(status, "name", str(status)).lower()
    return {"finished": "finished", "cancelled": "cancelled", "timed_out": "timed_out", "rejected": "rejected"}.get(
        name, "failed"
    )


def _seconds(ms: float | int | None) -> float | None:
    return None if ms is None else ms / 1000.0


def _deliver(batch: list[tuple[asyncio.Queue, list[Any]]]) -> None:
    for queue, events in batch:
        queue.put_nowait(events)


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        load_runner: Callable[[ProgressFn], Runner],
        metrics: EngineMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        request_log: RequestLog | None = None,
        cost_model: Any = None,
        cost_model_document: dict[str, Any] | None = None,
        freeze_heap_when_loaded: bool = False,
    ) -> None:
        self.config = config
        self.freeze_heap_when_loaded = freeze_heap_when_loaded
        self.cost_model = cost_model  # the step-cost model preemptionMode auto decides by (sim/cost.py)
        # Its document (GET /debug/cost-model); without one given, the runner's calibration supplies both.
        self.cost_model_document = cost_model_document
        # The limits and the served-step learner (sim/served_limits.py), set when the model loads.
        self.limits_follower: LimitsFollower | None = None
        # The cost model fitted to served steps (sim/cost.py ServedCost), learned from every step the
        # loop serves; None without a model in seconds.
        self.served_cost: Any = None
        self.scheduler_cost_model: Any = None  # what the scheduler bounds steps by (LimitsFollower.bound)
        self.scheduler_limits: SchedulerLimits | None = None  # what the scheduler runs with
        # The engine's clock at its start: recorded traces and the served margin's history
        # (GET /debug/cost-model) count seconds from it, so a replay of the one follows the other; the
        # request log's on the same clock, so its decisions (GET /debug/decisions) count from it too.
        self.origin = request_log.origin if request_log is not None and request_log.clock is clock else clock()
        # recordTrace: ended requests go to a writer thread as trace lines (server/trace_recorder.py).
        self.trace_recorder: TraceRecorder | None = None
        if config.record_trace is not None:
            self.trace_recorder = TraceRecorder(config.record_trace, self.origin, config.kv_cache.block_size)
        draft = config.draft_model
        # Speculation's on/off state (mode auto: measured, engine/speculation.py); None without a draft.
        self.speculation = (SpeculationPolicy(draft.mode, lookahead=draft.num_speculative_tokens)
                            if draft is not None else None)
        self.spec_method = draft.method if draft is not None else ""
        if self.speculation is not None:
            metrics.set_speculation_enabled(self.spec_method, self.speculation.enabled)
        self.request_log = request_log if request_log is not None else RequestLog(clock)
        metrics.register_decisions(self.request_log.decision_counts)
        self.stall_timeout_s = stall_timeout_s
        self.metrics = metrics
        self.clock = clock
        self._load_runner = load_runner
        self.phase = "starting"
        self.phase_progress = 0.0
        self.phase_detail: dict[str, Any] = {}
        self.load_seconds: float | None = None
        self.error: str | None = None
        self.runner: Runner | None = None
        self.renderer: PromptRenderer | None = None
        self.loop: EngineLoop | None = None
        self.model_name = ""
        self.max_model_len = 0
        self.kv_capacity_tokens = 0  # tokens the device KV pool holds (0 while loading)
        self.quantization: dict[str, Any] | None = None  # the evaluation record's summary, for quantized weights
        self.max_prompt_chars = 0  # longer prompts cannot fit the context: refused before tokenizing
        self.max_body_bytes: int | None = None  # what a request that fits the context can need
        self.stopping = False
        self.shed_classes: set[str] = set()
        self.last_stats: StepStats | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._ready_event = threading.Event()
        # Called (loop thread) once the engine loop has died and its requests were failed:
        # `magnitude serve` makes the process exit so that the pod is restarted.
        self.on_engine_dead: Callable[[BaseException], None] | None = None
        # Called with the exception when loading fails (`magnitude serve` exits 2 on a refused draft model).
        self.on_load_failed: Callable[[BaseException], None] | None = None
        self._draft_failure_seen = False

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Call from the event loop: loading proceeds in a background thread."""
        self._aio = asyncio.get_running_loop()
        threading.Thread(target=self._load, name="magnitude-loader", daemon=True).start()

    def _on_progress(self, phase: str, fraction: float, detail: dict[str, Any] | None = None) -> None:
        # detail: what the phase reports beyond a fraction (downloading: bytes_done, bytes_total).
        self.phase, self.phase_progress = phase, max(0.0, min(1.0, float(fraction)))
        self.phase_detail = dict(detail or {})

    def _load(self) -> None:
        t0 = time.monotonic()
        try:
            self.phase = "resolving"
            runner = self._load_runner(self._on_progress)
            from magnitude.engine.scheduler import Scheduler

            self.runner = runner
            self.model_name = runner.model_name
            if not self._accept_quantization(runner):
                return
            self.max_model_len = min(runner.max_model_len, self.config.admission.max_model_len or runner.max_model_len)
            self.kv_capacity_tokens = runner.num_blocks * self.config.kv_cache.block_size
            self.renderer = PromptRenderer(runner.tokenizer)
            if self.trace_recorder is not None:
                self.trace_recorder.detokenize = runner.tokenizer.decode
            self.max_prompt_chars = self.renderer.max_prompt_chars(self.max_model_len)
            self.max_body_bytes = context_body_bytes(self.max_prompt_chars, self.max_model_len)
            scheduler_config = self._derive_limits(runner)
            scheduler = Scheduler(
                scheduler_config,
                num_blocks=runner.num_blocks,
                num_swap_blocks=runner.num_swap_blocks,
                max_model_len=self.max_model_len,
                cost_model=self.scheduler_cost_model,
            )
            if self.shed_classes:
                scheduler.set_shedding(set(self.shed_classes))
            if self.freeze_heap_when_loaded:
                freeze_loaded_heap()
            self.loop = EngineLoop(scheduler, runner, self, clock=self.clock)
            self.loop.start()
            self.load_seconds = time.monotonic() - t0
            self.metrics.model_load_seconds.set(self.load_seconds)
            self.metrics.set_model_info(self.model_name, str(getattr(runner, "device", "none")),
                                        str(getattr(runner, "dtype", "none")).removeprefix("torch."),
                                        getattr(runner, "quantization", "none"))
            self.metrics.engine_ready.set(1)
            self.phase, self.phase_progress, self.phase_detail = "ready", 1.0, {}
            log.info("engine ready: %s in %.1fs", self.model_name, self.load_seconds)
        except Exception as exc:  # noqa: BLE001 - a failed load is reported by /readyz, not a crash
            log.exception("model loading failed")
            self.error = f"{type(exc).__name__}: {exc}"
            self.phase = "failed"
            if self.on_load_failed is not None:
                self.on_load_failed(exc)
        finally:
            self._ready_event.set()

    def _derive_limits(self, runner: Runner) -> EngineConfig:
        """The config the scheduler runs with: a null tokenBudget / prefillChunkSize derived from the
        cost model (given with --cost-model, else the runner's start-up calibration) and the ITL target;
        reported on /readyz (`scheduler`) and as magnitude_scheduler_* gauges. Also the model the
        scheduler bounds steps by, for an explicit or a derived target alike: the table scaled to what
        served steps take (ServedCost, learned from every step in after_step; the table's own times
        until enough are judged), with a margin for their scatter (a cold start's until then, which a
        derived target carries from the start: sim/cost.py SERVED_COLD_MARGIN)."""
        if self.cost_model_document is None:
            self.cost_model_document = getattr(runner, "cost_model_document", None)
        if self.cost_model is None and self.cost_model_document is not None:
            self.cost_model = cost_model_from_document(self.cost_model_document, "calibrated cost model",
                                                       self.config.kv_cache.block_size)
        # From the table, a --cost-model document's too: its served line is what another run's steps took.
        follower = self.limits_follower = LimitsFollower(self.config.scheduler, self.cost_model,
                                                         cold_margin=SERVED_COLD_MARGIN)
        self.served_cost = follower.served
        self.scheduler_cost_model = follower.bound
        limits = self.scheduler_limits = follower.limits
        if limits.warning:
            log.warning("scheduler: %s", limits.warning)
        self.metrics.set_scheduler_limits(limits.token_budget, limits.prefill_chunk_size, limits.itl_target_ms,
                                          limits.source)
        log.info("scheduler: tokenBudget %d, prefillChunkSize %d, itlTargetMs %s (%s)", limits.token_budget,
                 limits.prefill_chunk_size, limits.itl_target_ms, limits.source)
        return apply_limits(self.config, limits)

    def _accept_quantization(self, runner: Runner) -> bool:
        """Judge the runner's quantization evaluation record (if its weights are quantized) against
        the config's thresholds; False leaves the engine in phase `quantization_rejected`."""
        record = getattr(runner, "quantization_record", None)
        if record is None:
            return True
        verdict = judge(record, self.config.quantization_evaluation)
        self.quantization = summary(record, verdict)
        self.metrics.set_quantization_record(self.model_name, self.quantization)
        figures = (f"{record.method}: top-1 agreement {record.top1_agreement:.3f}, mean KL {record.mean_kl:.4f}, "
                   f"probes {record.probes_passed}/{record.probes_total} on {record.isa}")
        if verdict.passed:
            log.info("quantization evaluation passed: %s", figures)
            return True
        if verdict.serve:
            log.warning("quantization evaluation failed (%s) but quantizationEvaluation.enforce is false: serving %s",
                        "; ".join(verdict.failures), figures)
            return True
        log.error("quantization evaluation failed (%s): not serving %s", "; ".join(verdict.failures), figures)
        self.phase, self.phase_progress = "quantization_rejected", 1.0
        return False

    @property
    def ready(self) -> bool:
        return self.phase == "ready" and self.loop is not None and self.loop.running and not self.stopping

    @property
    def dead(self) -> str | None:
        """Why the engine can never serve again (its loop died), or None. Loading, shutting down
        and a deliberately not-ready phase are alive: liveness must not restart them."""
        if self.loop is not None and self.loop.dead is not None:
            return "the engine loop failed; the server log has the cause"  # logged when it died
        return None

    @property
    def liveness_failure(self) -> tuple[str, str] | None:
        """(status, message) when a restart is the fix: the loop died, or one step has hung past
        `stall_timeout_s`; None while alive, loading and deliberately not ready included."""
        if self.dead is not None:
            return "dead", self.dead
        stalled = self.loop.stalled_for() if self.loop is not None else 0.0
        if stalled > self.stall_timeout_s:
            return "stalled", f"one engine step has run {stalled:.1f} s, over the stall timeout of {self.stall_timeout_s} s"
        return None

    def not_ready_reason(self) -> tuple[str, str]:
        if self.dead is not None:
            return "dead", self.dead
        if self.stopping:
            return "shutting_down", "server is shutting down"
        if self.phase == "quantization_rejected" and self.quantization is not None:
            return self.phase, ("the quantized weights failed their evaluation record: " + "; ".join(
                self.quantization["failures"]) + " (set quantizationEvaluation.enforce: false to serve anyway)")
        if self.phase == "failed":
            return "failed", "model loading failed; the server log has the cause"  # logged when it failed
        return self.phase, f"model is loading (phase {self.phase}, {self.phase_progress:.0%})"

    async def wait_ready(self, on_progress: Callable[[Progress], Any] | None = None, timeout_s: float = 600.0) -> None:
        """Wait for loading to finish, reporting phase changes; raises NotReady if it fails."""
        last = None
        deadline = time.monotonic() + timeout_s
        while not self._ready_event.is_set() and time.monotonic() < deadline:
            cur = (self.phase, round(self.phase_progress, 2))
            if cur != last and on_progress is not None:
                await on_progress(Progress("loading", {"stage": self.phase, "progress": cur[1]}))
            last = cur
            await asyncio.sleep(0.2)
        if not self.ready:
            raise NotReady(*self.not_ready_reason())

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop admitting; let in-flight requests finish within `grace_s`; cancel the rest; stop the loop."""
        self.stopping = True
        deadline = time.monotonic() + grace_s
        while self._tracked and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.loop is not None:
            for rid in list(self._tracked):
                self.loop.abort(rid, reason="shutdown")
            end = time.monotonic() + 5.0
            while self._tracked and time.monotonic() < end and self.loop.running:
                await asyncio.sleep(0.02)
            await asyncio.to_thread(self.loop.stop)
        if self.trace_recorder is not None:
            await asyncio.to_thread(self.trace_recorder.close)  # what was recorded reaches the file
        self.metrics.engine_ready.set(0)

    # -- shedding -----------------------------------------------------------------------------------
    def shed_order(self) -> list[str]:
        return self.config.scheduler.shed_order()

    def set_shedding(self, enabled: bool, levels: int = 1, classes: list[str] | None = None) -> list[str]:
        """Shed `classes`, or the `levels` least important classes (never the most important one).

        Raises ValueError naming an unknown class."""
        order = self.shed_order()
        if classes is not None and enabled:
            unknown = [c for c in classes if c not in order]
            if unknown:
                raise ValueError(f"unknown priority classes {unknown}; known: {order}")
            shed = [c for c in order if c in classes]
        else:
            shed = order[: min(levels, len(order) - 1)] if enabled else []
        if set(shed) != self.shed_classes:
            self.request_log.shed(self.clock(), shed)
        self.shed_classes = set(shed)
        if self.loop is not None:
            with self.loop.lock:
                self.loop.scheduler.set_shedding(set(shed))
        self.metrics.set_shedding(shed)
        return shed

    # -- requests (event-loop thread) ---------------------------------------------------------------
    def submit(self, spec: RequestSpec, request_id: str | None = None) -> RequestStream:
        if not self.ready:
            raise NotReady(*self.not_ready_reason())
        assert self.loop is not None and self.runner is not None
        from magnitude.engine.request import Request
        from magnitude.runner.detokenize import IncrementalDetokenizer

        now = self.clock()
        # Arrival is when the HTTP request came in: aging, deadlines, TTFT and e2e count preparation.
        arrival = now if spec.arrival is None else min(spec.arrival, now)
        request_id = request_id or new_request_id()
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(spec.prompt_token_ids),
            num_prompt_tokens=len(spec.prompt_token_ids),
            sampling=spec.sampling,
            arrival_time=arrival,
            priority_class=spec.priority_class,
            tenant=spec.tenant,
            deadline=None if spec.deadline_ms is None else arrival + spec.deadline_ms / 1000.0,
            eos_token_ids=list(self.runner.eos_token_ids),
            cache_key=f"{self.model_name}|{spec.tenant}",
        )
        stream = RequestStream(request_id, self)
        tokenizer = self.runner.tokenizer
        detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=spec.prompt_token_ids)
        out = OutputState(tokenizer, detok, spec.sampling.stop, spec.sampling.logprobs is not None)
        tracked = _Tracked(request=request, spec=spec, stream=stream, out=out)
        with self.loop.lock:
            self._tracked[request_id] = tracked
            self.request_log.open(
                request_id, arrival=arrival, enqueued=now, prompt_tokens=request.num_prompt_tokens,
                priority_class=spec.priority_class, tenant=spec.tenant, loading_s=spec.loading_s,
                client_id=spec.client_request_id,
            )
            decision = self.loop.add_request(request)
            if not decision.accepted:
                del self._tracked[request_id]
                # File the scheduler's reject event now, so the timeline explains the 429 it answers
                # (other requests' events drained with it are handled as after a step).
                self._finalize_from_events(self._dispatch_events(now, now, None, []))
                self._flush()
                reason = decision.reason or "rejected"
                self.metrics.observe_rejection(reason, spec.priority_class)
                timing = self.request_log.close(request_id, "rejected", now, [])
                self._record_trace(request, "rejected", now, now)
                self.metrics.observe_request(
                    RequestRecord(spec.priority_class, spec.tenant, "rejected", arrival, prompt_tokens=request.num_prompt_tokens,
                                  preparation_s=_seconds(timing.get("preparation_ms")))
                )
                raise Rejected(reason, decision.retry_after_s)
            position = self.loop.scheduler.queue_position(request_id)
            self.request_log.queued(request_id, now, position)
            if spec.include_progress:
                # `preparing` reports the preparation admission waited for (it needs the token count);
                # it is sent once preparation is over, because a preparation error is an HTTP status.
                prepared_ms = round(max(0.0, now - arrival - spec.loading_s) * 1000.0, 3)
                progress = [Progress("preparing", {"prompt_tokens": request.num_prompt_tokens, "ms": prepared_ms})]
                if position is not None:
                    tracked.last_position = position
                    progress.append(Progress("queued", {"position": position}))
                stream._queue.put_nowait(progress)
        return stream

    def abort(self, request_id: str) -> None:
        if self.loop is not None and request_id in self._tracked:
            self.loop.abort(request_id)

    def refresh_gauges(self) -> None:
        if self.loop is not None:
            with self.loop.lock:
                self.metrics.set_gauges(stats_of(self.loop.scheduler, self.clock(), 0.0, None))

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)

    # -- the loop thread's side (StepObserver) --------------------------------------------------------
    def after_step(self, plan: StepPlan | None, output: RunnerOutput | None, updates: list[Any], stats: StepStats) -> None:
        assert self.loop is not None
        self.last_stats = stats
        if plan is not None and plan.seqs:
            self.metrics.observe_step(stats)
        else:
            self.metrics.set_gauges(stats)
        now = stats.t
        if plan is not None:
            self._prefill_progress(plan)
        events = self._dispatch_events(now - stats.duration_s, now, plan, updates)
        sampled = output.sampled if output is not None else {}
        if self.speculation is not None and plan is not None and plan.seqs and output is not None:
            self._observe_speculation(plan, output, stats)
        if self.served_cost is not None:
            self._observe_served_step(plan, output, stats)
        for upd in updates:
            tr = self._tracked.get(upd.request_id)
            if tr is None or tr.done:
                continue
            try:
                self._apply_update(tr, upd, sampled.get(upd.request_id), now)
            except Exception:  # noqa: BLE001 - one request's failure must not stop the loop
                log.exception("output processing failed for request id %s", upd.request_id)
                self.loop.scheduler.abort(upd.request_id, now, reason="output_error")
                self._fail(tr, "failed", 500, internal_error_message(upd.request_id), "internal_error")
        self._finalize_from_events(events)
        self._queue_positions()
        self._flush()

    def _observe_served_step(self, plan: StepPlan | None, output: RunnerOutput | None, stats: StepStats) -> None:
        """Judge the step against the table, count the gap it closed against the ITL target
        (magnitude_scheduler_itl_gaps_total) and, when the follower derives new limits from served
        steps (sim/served_limits.py: at SERVED_MIN_STEPS judged steps, then every SERVED_DERIVE_STEPS
        more; null limits only), hand them to the scheduler."""
        assert self.limits_follower is not None
        decoding = plan is not None and output is not None and stats.num_decode > 0
        change = self.limits_follower.after_step(plan, stats.t - stats.duration_s, decoding,
                                                 failed=output is not None and bool(output.failed))
        if self.limits_follower.last_itl_gap is not None:
            self.metrics.observe_itl_gap(*self.limits_follower.last_itl_gap)
        if change is not None:
            self._follow_served_steps(change)

    def _follow_served_steps(self, change: LimitsChange) -> None:
        """Run with limits derived again from served steps: the scheduler's next steps, /readyz, the
        magnitude_scheduler_* gauges and the log."""
        assert self.loop is not None and self.served_cost is not None
        old, new = change.old, change.new
        self.loop.scheduler.set_limits(new.token_budget, new.prefill_chunk_size, new.itl_target_ms,
                                       self.scheduler_cost_model)
        self.scheduler_limits = new
        self.metrics.set_scheduler_limits(new.token_budget, new.prefill_chunk_size, new.itl_target_ms, new.source)
        log.info("scheduler: tokenBudget %d, prefillChunkSize %d, itlTargetMs %s (derived again from %d served "
                 "steps: %.1f ms + %.2f ms a decode + %.3fx the table, bounded with a %.0f%% margin; were %d, %d, %s)",
                 new.token_budget, new.prefill_chunk_size, new.itl_target_ms, self.served_cost.steps,
                 self.served_cost.fixed_s * 1000.0, self.served_cost.per_decode_s * 1000.0, self.served_cost.factor,
                 self.served_cost.margin * 100.0, old.token_budget, old.prefill_chunk_size, old.itl_target_ms)

    def _draft_failed(self) -> bool:
        """Whether the runner's draft model failed at run time (runner/draft_model.py: it drafts no
        more): the first time, speculation is switched off for good and
        magnitude_spec_decode_enabled{method} goes to 0, whatever mode says."""
        assert self.loop is not None
        reason = getattr(getattr(self.runner, "draft_proposer", None), "failed", None)
        if reason is None:
            return False
        if not self._draft_failure_seen:
            self._draft_failure_seen = True
            log.error("speculation off for good: the draft model failed (%s)", reason)
            self.loop.scheduler.set_speculation(False)
            self.metrics.set_speculation_enabled(self.spec_method, False)
        return True

    def _observe_speculation(self, plan: StepPlan, output: RunnerOutput, stats: StepStats) -> None:
        """Draft counters per priority class, and the auto policy's decision for the next step."""
        assert self.loop is not None and self.speculation is not None
        if self._draft_failed():
            return
        decodes = tokens = 0
        for seq in plan.seqs:
            sampled = output.sampled.get(seq.request_id)
            if not (seq.sample and seq.num_tokens == 1 and sampled):
                continue
            decodes += 1
            tokens += len(sampled)
            proposed = output.num_drafts.get(seq.request_id, 0)
            tr = self._tracked.get(seq.request_id)
            if proposed and tr is not None:
                self.metrics.observe_speculation(tr.spec.priority_class, self.spec_method, proposed, len(sampled) - 1)
                self.metrics.observe_spec_step(tr.spec.priority_class, self.spec_method, len(sampled))
        prefill, drafted = stats.num_prefill_tokens > 0, bool(output.num_drafts)
        if drafted and not prefill:  # estimated against the plain step cost measured so far
            saved = self.speculation.saved_seconds(stats.duration_s, decodes, tokens)
            if saved is not None:
                self.metrics.observe_time_saved(self.spec_method, saved)
        was = self.speculation.enabled
        on = self.speculation.observe(stats.duration_s, decodes, tokens, prefill=prefill, drafted=drafted)
        if on != was:
            log.info("speculation %s (auto: measured gain %s)", "on" if on else "off", self.speculation.gain())
            self.loop.scheduler.set_speculation(on)
            self.metrics.set_speculation_enabled(self.spec_method, on)

    def _dispatch_events(self, start: float, end: float, plan: StepPlan | None, updates: list[Any]) -> list[Any]:
        """Drain the scheduler's decisions into the request log (with this step's chunks and first
        tokens); returns them for `_finalize_from_events`. Under the loop lock."""
        assert self.loop is not None
        events = self.loop.scheduler.drain_events()
        if events or plan is not None or updates:
            self.request_log.observe_step(start, end, plan, events, updates)
        return events

    def _finalize_from_events(self, events: list[Any]) -> None:
        for ev in events:
            tr = self._tracked.get(ev.request_id) if ev.request_id else None
            if tr is not None and ev.kind == "admit" and ev.reason == "scheduled":
                self._observe_queue_time(tr)
            if tr is None or tr.done or ev.kind not in TERMINAL_EVENT_KINDS:
                continue
            self._finalize_from_status(tr, TERMINAL_EVENT_KINDS[ev.kind], ev.reason or ev.kind)

    def on_dead(self, exc: BaseException) -> None:
        self.metrics.engine_ready.set(0)
        for tr in list(self._tracked.values()):
            if not tr.done:
                self._fail_internal(tr, f"engine failed: {type(exc).__name__}: {exc}", "engine_dead")
        self._flush()
        if self.on_engine_dead is not None:
            self.on_engine_dead(exc)

    def _prefill_progress(self, plan: StepPlan) -> None:
        for seq in plan.seqs:
            tr = self._tracked.get(seq.request_id)
            if tr is None or not tr.spec.include_progress:
                continue
            total = tr.request.num_prompt_tokens
            if seq.start_position >= total:
                continue
            done = min(total, seq.start_position + seq.num_tokens)
            if done != tr.last_prefill:
                tr.last_prefill = done
                tr.events.append(Progress("prefill", {"done": done, "total": total}))

    def _apply_update(self, tr: _Tracked, upd: Any, sampled: Any, now: float) -> None:
        new = list(upd.new_token_ids or [])
        if new:
            if tr.spec.include_progress and not tr.generating_sent:
                tr.events.append(Progress("generating", {}))
            tr.generating_sent = True
            text, logprobs, stopped = tr.out.push(new, sampled)
            self.metrics.observe_tokens(tr.spec.priority_class, tr.spec.tenant, len(new))
            if text or logprobs:
                tr.events.append(Delta(text, new, logprobs))
            if stopped and not upd.finished:
                self.loop.scheduler.finish_request(tr.request.request_id, now, "stop")
                self._finish(tr, "stop", now)
                return
            if stopped:
                self._finish(tr, "stop", now)
                return
        if upd.finished:
            self._finalize_from_status(tr, _status_name(upd.status), upd.finish_reason or "stop")

    def _finalize_from_status(self, tr: _Tracked, status: str, reason: str) -> None:
        if status == "finished" and reason in ("stop", "length"):
            self._finish(tr, reason, None)
        elif status == "finished":  # finished with an error text (e.g. the runner failed this request)
            self._fail_internal(tr, f"request failed: {reason}", "request_failed")
        elif status == "timed_out":
            self._fail(tr, status, 504, f"deadline_ms exceeded: {reason}", "deadline_exceeded")
        elif status == "rejected":
            self.metrics.observe_rejection(reason, tr.spec.priority_class)
            self._fail(tr, status, 429, f"request rejected: {reason}", "rejected")
        elif status == "cancelled":
            self._fail(tr, status, 503, f"request cancelled: {reason}", "cancelled")
        else:
            self._fail_internal(tr, f"request failed: {reason}", "request_failed")

    def _observe_queue_time(self, tr: _Tracked) -> None:
        # The scheduler emits "admit/scheduled" once, when it sets admitted_time: one observation per request.
        # Queue time is time in the scheduler's queue: from the end of preparation, not from arrival.
        req = tr.request
        enqueued = self.request_log.enqueued_at(req.request_id)
        if req.admitted_time is not None and enqueued is not None:
            self.metrics.observe_queue_time(req.priority_class, req.tenant, req.admitted_time - enqueued)

    def _close(self, tr: _Tracked, status: str, end: float | None) -> tuple[dict[str, float | int | None], RequestRecord]:
        """Freeze the request's timeline (its timing is the response's) and build the metrics record."""
        req = tr.request
        times = list(getattr(req, "token_times", []) or [])
        finished = getattr(req, "finish_time", None) or end or (times[-1] if times else None) or self.clock()
        proposed = getattr(req, "spec_proposed", 0)
        acceptance = round(req.spec_accepted / proposed, 4) if proposed else None
        timing = self.request_log.close(req.request_id, status, finished, times, acceptance)
        waited_ms = (timing.get("loading_ms") or 0.0) + (timing.get("preparation_ms") or 0.0)
        self._record_trace(req, status, finished, req.arrival_time + float(waited_ms) / 1000.0)
        rec = RequestRecord(
            priority_class=req.priority_class,
            tenant=req.tenant,
            status=status,
            arrival=req.arrival_time,
            admitted=req.admitted_time,
            first_token=req.first_token_time,
            finished=finished,
            token_times=times,
            prompt_tokens=req.num_prompt_tokens,
            output_tokens=len(getattr(req, "output_token_ids", []) or []),
            preparation_s=_seconds(timing.get("preparation_ms")),
            prefill_s=_seconds(timing.get("prefill_ms")),
        )
        return timing, rec

    def _record_trace(self, req: Any, status: str, end: float, queued: float | None) -> None:
        if self.trace_recorder is None:
            return
        self.trace_recorder.record(Ended(
            request_id=req.request_id, arrival=req.arrival_time, queued=queued,
            prompt_token_ids=req.prompt_token_ids or [], output_tokens=len(req.output_token_ids),
            priority_class=req.priority_class, tenant=req.tenant, status=status, end=end, deadline=req.deadline,
            isolation_key=req.cache_key, extra={"expected_output_tokens": req.expected_output_tokens},
        ))

    def _finish(self, tr: _Tracked, finish_reason: str, end: float | None) -> None:
        tail = tr.out.finish()
        if tail:
            tr.events.append(Delta(tail, [], []))
        timing, rec = self._close(tr, "finished", end)
        self.metrics.observe_request(rec)
        tr.events.append(Finished(finish_reason, rec.prompt_tokens, rec.output_tokens, timing))
        tr.done = True

    def _fail(self, tr: _Tracked, status: str, http_status: int, message: str, code: str) -> None:
        _, rec = self._close(tr, status, self.clock())
        self.metrics.observe_request(rec)
        tr.events.append(Failed(http_status, message, code))
        tr.done = True

    def _fail_internal(self, tr: _Tracked, cause: str, code: str) -> None:
        """A 500 whose cause is ours: the cause is logged with the request id, the client gets a
        generic message naming that id."""
        log.error("request id %s failed (%s): %s", tr.request.request_id, code, cause)
        self._fail(tr, "failed", 500, internal_error_message(tr.request.request_id), code)

    def _queue_positions(self) -> None:
        assert self.loop is not None
        waiting = [
            tr
            for tr in self._tracked.values()
            if not tr.done and tr.spec.include_progress and tr.last_prefill < 0 and not tr.generating_sent
        ]
        if not waiting:
            return
        # One ordered pass over the queue per step (index = live requests ahead, as queue.position()
        # counts them), instead of an O(queue) position() per waiting stream.
        positions = {r.request_id: i for i, r in enumerate(self.loop.scheduler.queue)}
        for tr in waiting:
            pos = positions.get(tr.request.request_id)
            if pos is not None and pos != tr.last_position:
                tr.last_position = pos
                tr.events.append(Progress("queued", {"position": pos}))

    def _flush(self) -> None:
        """Hand this step's events to the streams with one wake-up of the event loop, not one per request."""
        assert self._aio is not None
        batch = []
        for rid in list(self._tracked):
            tr = self._tracked[rid]
            if tr.events:
                batch.append((tr.stream._queue, tr.events))
                tr.events = []
            if tr.done:
                del self._tracked[rid]
        if batch:
            try:
                self._aio.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # event loop closed during shutdown
                pass
