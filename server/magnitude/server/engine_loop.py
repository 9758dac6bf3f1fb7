"""The engine loop: one thread runs schedule -> execute -> update while there is work.

It owns the scheduler: every scheduler call happens under `self.lock` (an RLock, so the
observer may call back into the loop). The forward pass (`runner.execute`) runs outside the lock,
so admission from the HTTP side never waits for a step. Aborts are queued and applied by the loop
thread before the next `schedule()`, which is "cancellation at the next step" and keeps the
scheduler's state stable while a plan executes.

Failure isolation: a runner exception for one step fails that step's requests (as
`RunnerOutput.failed`) and the loop continues; several consecutive whole-step failures, or any
exception from the scheduler itself, mark the loop dead (`dead` holds the exception) so `/readyz`
and liveness fail and Kubernetes restarts the pod. A step that hangs raises nothing:
`stalled_for()` says how long the running forward pass has taken, for liveness to judge.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from magnitude.engine.output import RunnerOutput, StepPlan

log = logging.getLogger("magnitude.engine_loop")

MAX_CONSECUTIVE_STEP_FAILURES = 3
EMPTY_PLAN_BACKOFF_S = 0.005


class StepRunner(Protocol):
    def execute(self, plan: StepPlan) -> RunnerOutput: ...


@dataclass(slots=True)
class StepStats:
    """What one step did and left behind; the metrics adapter and `/v1/stats`-style views read it."""

    t: float
    duration_s: float
    num_seqs: int = 0
    num_decode: int = 0
    num_prefill_tokens: int = 0
    running: int = 0
    waiting: int = 0
    swapped: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    kv_cached_blocks: int = 0  # unreferenced, still holding a reusable prefix
    swap_used_blocks: int = 0
    swap_total_blocks: int = 0
    num_tokens: int = 0  # scheduled this step (prefill chunks + decodes + lookahead)
    token_budget: int = 0
    max_sequences: int = 0
    # Cumulative since start (the metrics adapter turns them into counters).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_alloc_failures: int = 0
    preempted: list[tuple[str, str, str]] = field(default_factory=list)


class StepObserver(Protocol):
    def after_step(self, plan: StepPlan | None, output: RunnerOutput | None, updates: list[Any], stats: StepStats) -> None:
        """Called in the loop thread, under the lock, after each step (plan None: housekeeping while idle)."""

    def on_dead(self, exc: BaseException) -> None:
        """Called once, in the loop thread, when the loop stops because of an error."""


def stats_of(scheduler: Any, t: float, duration_s: float, plan: StepPlan | None) -> StepStats:
    s = scheduler.stats()
    stats = StepStats(
        t=t,
        duration_s=duration_s,
        running=s.running,
        waiting=s.waiting,
        swapped=getattr(s, "swapped", 0),
        kv_used_blocks=s.kv_used_blocks,
        kv_total_blocks=s.kv_total_blocks,
        kv_cached_blocks=s.kv_cached_free_blocks,
        swap_used_blocks=s.swap_used_blocks,
        swap_total_blocks=s.swap_total_blocks,
        token_budget=getattr(scheduler, "token_budget", 0),
        max_sequences=getattr(scheduler, "max_sequences", 0),
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        kv_alloc_failures=s.kv_alloc_failures,
    )
    if plan is not None:
        stats.num_seqs = len(plan.seqs)
        stats.num_tokens = plan.num_tokens  # one pass over the plan; the prefill count reuses it
        stats.num_decode = plan.num_decode
        stats.num_prefill_tokens = stats.num_tokens - stats.num_decode
        stats.preempted = list(plan.preempted)
    return stats


class EngineLoop:
    """Drives one scheduler and one runner from a dedicated thread."""

    def __init__(
        self,
        scheduler: Any,
        runner: StepRunner,
        observer: StepObserver,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.observer = observer
        self.clock = clock
        self.lock = threading.RLock()
        self._wake = threading.Condition(self.lock)
        self._pending_aborts: list[tuple[str, Any, str]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.dead: BaseException | None = None
        self.steps = 0
        self._failures = 0
        self.step_started: float | None = None  # clock() when the running forward pass began; None between

    # -- control (any thread) -----------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="magnitude-engine-loop", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def stop(self, timeout: float | None = 5.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def add_request(self, request: Any) -> Any:
        """Admission happens here, synchronously, so the caller can answer 429 at once."""
        with self._wake:
            decision = self.scheduler.add_request(request, self.clock())
            self._wake.notify_all()
            return decision

    def abort(self, request_id: str, status: Any = None, reason: str = "client_disconnected") -> None:
        """Queue an abort; the loop applies it before its next schedule()."""
        with self._wake:
            self._pending_aborts.append((request_id, status, reason))
            self._wake.notify_all()

    def wake(self) -> None:
        with self._wake:
            self._wake.notify_all()

    # -- the thread -----------------------------------------------------------------------------
    def _apply_aborts(self, now: float) -> bool:
        aborts, self._pending_aborts = self._pending_aborts, []
        for request_id, status, reason in aborts:
            if status is None:
                self.scheduler.abort(request_id, now, reason=reason)
            else:
                self.scheduler.abort(request_id, now, status=status, reason=reason)
        return bool(aborts)

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    now = self.clock()
                    if self._apply_aborts(now):
                        self.observer.after_step(None, None, [], stats_of(self.scheduler, now, 0.0, None))
                    while not self._stopping and not self._pending_aborts and not self.scheduler.has_work():
                        self.observer.after_step(None, None, [], stats_of(self.scheduler, self.clock(), 0.0, None))
                        self._wake.wait()
                    if self._stopping:
                        return
                    if self._pending_aborts:
                        continue
                    start = self.clock()
                    plan = self.scheduler.schedule(start)
                if plan.is_empty:
                    self._idle_step(plan, start)
                    continue
                output = self._execute(plan)
                with self._wake:
                    now = self.clock()
                    updates = self.scheduler.update_from_output(plan, output, now)
                    self.steps += 1
                    self.observer.after_step(plan, output, updates, stats_of(self.scheduler, now, now - start, plan))
        except BaseException as exc:  # noqa: BLE001 - any loop failure must surface as "dead", not vanish
            log.exception("engine loop died")
            self.dead = exc
            try:
                self.observer.on_dead(exc)
            except Exception:  # noqa: BLE001
                log.exception("observer.on_dead failed")

    def _idle_step(self, plan: StepPlan, start: float) -> None:
        """Work exists but nothing was schedulable this instant: report, then back off briefly."""
        with self._wake:
            now = self.clock()
            self.observer.after_step(plan, None, [], stats_of(self.scheduler, now, 0.0, plan))
            if not plan.released and not self._stopping and not self._pending_aborts:
                self._wake.wait(EMPTY_PLAN_BACKOFF_S)

    def stalled_for(self) -> float:
        """Seconds the forward pass now running has taken (0.0 between steps): a hung device or
        deadlock never raises, so liveness watches this instead."""
        started = self.step_started
        return 0.0 if started is None else max(0.0, self.clock() - started)

    def _execute(self, plan: StepPlan) -> RunnerOutput:
        self.step_started = self.clock()
        try:
            output = self.runner.execute(plan)
            self._failures = 0
            return output
        except Exception as exc:  # noqa: BLE001 - one bad step fails its requests, not the engine
            self._failures += 1
            log.exception("runner failed a step (%d in a row)", self._failures)
            if self._failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            message = f"runner error: {type(exc).__name__}: {exc}"
            return RunnerOutput(failed={s.request_id: message for s in plan.seqs})
        finally:
            self.step_started = None
