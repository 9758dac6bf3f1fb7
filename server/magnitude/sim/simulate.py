"""Replay a trace through the real `Scheduler` on a virtual clock; only the runner is replaced,
by a cost model. No second copy of the policy lives here.

Time rule (DESIGN §3): a step that starts at `t` and lasts `d` emits its tokens at `t + d`; the
next step starts then, or at the next arrival when idle. Arrivals and cancellations are heap
events; a step's end is one too, ordered before arrivals at the same instant.

The limits follow served steps as the engine's do (sim/served_limits.py): a replay starts from the
limits its table derives, judges the steps it simulates, and derives null limits again on the
engine's schedule. With a `GET /debug/cost-model` document the simulated steps take the served
line's times (what the engine's steps took), so a replay learns them as the engine did, rather
than running the whole trace with the limits the engine ended with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from magnitude.engine.events import SchedulerEvent
from magnitude.engine.output import RunnerOutput, SampledToken, StepPlan
from magnitude.engine.request import Request
from magnitude.engine.sampling import SamplingParams
from magnitude.engine.scheduler import Scheduler
from magnitude.policy.schema import EngineConfig
from magnitude.sim.clock import ARRIVAL, CANCEL, STEP_END, EventHeap
from magnitude.sim.cost import (SERVED_COLD_MARGIN, CostModel, SchedulerLimits, ServedCost, apply_limits, plan_shape,
                                replay_step_seconds)
from magnitude.sim.served_limits import LimitsChange, LimitsFollower
from magnitude.sim.speculation import SpecModel, spec_simulation
from magnitude.sim.trace import TraceError, TraceRecord, prefix_token_ids

DEFAULT_SIM_BLOCKS = 2048  # when kvCache.numBlocks is null (the engine sizes it from memory)


@dataclass(slots=True)
class StepRecord:
    t: float
    duration: float
    decode: list[str]
    prefill: list[tuple[str, int]]
    preempted: list[tuple[str, str, str]]
    kv_used_blocks: int
    kv_total_blocks: int
    waiting: int
    running: int
    swapped: int


@dataclass
class SimResult:
    config: EngineConfig
    cost_model: str
    requests: list[tuple[TraceRecord, Request]]
    steps: list[StepRecord] = field(default_factory=list)
    events: list[SchedulerEvent] = field(default_factory=list)
    end_time: float = 0.0
    speculation: dict[str, object] | None = None  # sim/speculation.py's figures when draftModel is set
    # (time, limits) each time the limits were derived again from simulated served steps.
    limits_changes: list[tuple[float, SchedulerLimits]] = field(default_factory=list)


class CostModelRunner:
    """A runner stand-in: the step's duration from a cost model and deterministic token ids.
    The server's `--runner simulated` wraps this and sleeps `duration_s`."""

    def __init__(self, cost_model: CostModel):
        self.cost_model = cost_model

    def execute(self, plan: StepPlan, now: float | None = None) -> RunnerOutput:
        """`now`: when the step starts, on the clock of the document's histories: a served model
        that carries its line's history prices the step on the line in force then (a replay of
        the engine's recorded traffic, ServedCost.step_seconds_at); without it, on its own line. A
        served model prices a prefill-only step by its own ratio where it has one
        (ServedCost.replayed_seconds)."""
        sampled = {
            s.request_id: [SampledToken(1000 + (s.num_output_tokens % 1000))] for s in plan.seqs if s.sample
        }
        return RunnerOutput(sampled=sampled, duration_s=replay_step_seconds(self.cost_model, plan, now))


def resolve_sim_config(config: EngineConfig, cost_model: CostModel) -> EngineConfig:
    """Fill what the engine would measure: kvCache.numBlocks when null, and a null tokenBudget /
    prefillChunkSize derived from the cost model's table for the ITL target, as the engine starts."""
    return _with_sim_blocks(apply_limits(config, LimitsFollower(config.scheduler, cost_model,
                                                                cold_margin=cold_margin(cost_model)).limits))


def cold_margin(cost_model: CostModel) -> float:
    """The margin a simulated engine's bound keeps until its line is fitted: an engine's document
    (served step times: a replay of that engine) starts cold as the engine did; a table's steps take
    the table and keep none (SERVED_COLD_MARGIN)."""
    return SERVED_COLD_MARGIN if isinstance(cost_model, ServedCost) else 0.0


def _with_sim_blocks(config: EngineConfig) -> EngineConfig:
    if config.kv_cache.num_blocks is not None:
        return config
    return config.model_copy(update={"kv_cache": config.kv_cache.model_copy(update={"num_blocks": DEFAULT_SIM_BLOCKS})})


def to_request(rec: TraceRecord, config: EngineConfig) -> Request:
    return Request(
        request_id=rec.id,
        prompt_token_ids=prefix_token_ids(rec),  # None without prefix groups: no prefix-cache hits
        num_prompt_tokens=rec.prompt_tokens,
        sampling=SamplingParams(max_tokens=rec.output_tokens, ignore_eos=True),
        arrival_time=rec.arrival,
        priority_class=rec.priority_class or config.scheduler.default_priority_class,
        tenant=rec.tenant or "default",
        deadline=rec.deadline,
    )


def check_trace(records: list[TraceRecord], config: EngineConfig, source: str = "trace") -> None:
    """Refuse what the config cannot interpret (unknown priority class), naming the line."""
    known = {c.name for c in config.scheduler.priority_classes}
    for lineno, rec in enumerate(records, 1):
        if rec.priority_class is not None and rec.priority_class not in known:
            raise TraceError(
                f"{source}:{lineno}: priority_class: unknown priority class {rec.priority_class!r} "
                f"(configured: {', '.join(sorted(known))})"
            )


def simulate(records: list[TraceRecord], config: EngineConfig, cost_model: CostModel, keep_events: bool = True,
             speculation: SpecModel | None = None) -> SimResult:
    """`speculation`: the acceptance and draft cost to simulate a config's draftModel with (sim/speculation.py)."""
    # The engine starts from its table and learns what its steps take; here they take `cost_model`'s times
    # (on the line in force at each step's start where the document dates the line's moves), which do
    # not scatter: the bound keeps the engine's margin for its steps' scatter (a document's), as it moved
    # over the engine's clock where the document dates it (recorded traces share that clock).
    served = cost_model if isinstance(cost_model, ServedCost) else None
    follower = LimitsFollower(config.scheduler, cost_model, served.margin if served else 0.0,
                              tuple(served.margin_history) if served else (), cold_margin(cost_model))
    config = _with_sim_blocks(apply_limits(config, follower.limits))
    check_trace(records, config)
    sched = Scheduler(config, cost_model=follower.bound)
    spec = spec_simulation(config, cost_model, speculation,
                           {r.id: r.priority_class or config.scheduler.default_priority_class for r in records})
    runner = spec if spec is not None else CostModelRunner(cost_model)
    heap = EventHeap()
    pairs = [(rec, to_request(rec, config)) for rec in records]
    result = SimResult(config, cost_model.name, pairs)
    for rec, req in pairs:
        # A recorded request reaches the queue after its preparation; its arrival (aging, TTFT) stays the HTTP one.
        queued = rec.arrival + (rec.preparation or 0.0)
        heap.push(queued, ARRIVAL, req)
        if rec.cancel_at is not None:
            # A cancel at or before its queueing goes right after its arrival (cancels sort first at one instant).
            at = rec.cancel_at if rec.cancel_at > queued else math.nextafter(queued, math.inf)
            heap.push(at, CANCEL, req.request_id)

    in_flight: tuple[StepPlan, RunnerOutput, float] | None = None
    now = 0.0
    while heap:
        now, kind, payload = heap.pop()
        if kind == STEP_END:
            plan, output, start = payload
            sched.update_from_output(plan, output, now)
            if spec is not None:
                spec.after_step(sched, plan, output)
            result.steps.append(_record(plan, start, now - start, sched))
            in_flight = None
            _follow(follower.after_step(plan, start, plan_shape(plan, config.kv_cache.block_size)[0] > 0),
                    follower, sched, result, now)
        elif kind == CANCEL:
            sched.abort(payload, now)
        else:
            sched.add_request(payload, now)
        if keep_events:
            result.events.extend(sched.drain_events())
        else:
            sched.events.clear()
        if in_flight is not None or (heap.next_time() == now):
            continue  # a step is running, or more happens at this instant
        if not sched.has_work():
            # Nothing to do: the engine's loop idles here and tells its follower so (its chain of
            # judged steps breaks), and so does the replay's.
            _follow(follower.after_step(None, now, False), follower, sched, result, now)
            continue
        plan = sched.schedule(now)
        if plan.is_empty:
            _follow(follower.after_step(plan, now, False), follower, sched, result, now)  # the engine's idle step
            # schedule() itself may end the last work (a queued request's deadline passes): not a stall.
            if not heap and sched.has_work():
                raise RuntimeError(f"scheduler stalled at t={now} with work left: {sched.stats()}")
            continue
        output = runner.execute(plan, now) if isinstance(runner, CostModelRunner) else runner.execute(plan)
        in_flight = (plan, output, now)
        heap.push(now + output.duration_s, STEP_END, in_flight)
    if keep_events:
        result.events.extend(sched.drain_events())
    result.end_time = now
    if spec is not None:
        result.speculation = spec.stats.to_dict()
    return result


def _follow(change: LimitsChange | None, follower: LimitsFollower, sched: Scheduler, result: SimResult,
            now: float) -> None:
    """Run with limits the follower derived again, as the engine does."""
    if change is not None:
        new = change.new
        sched.set_limits(new.token_budget, new.prefill_chunk_size, new.itl_target_ms, follower.bound)
        result.limits_changes.append((now, new))


def _record(plan: StepPlan, start: float, duration: float, sched: Scheduler) -> StepRecord:
    decode, prefill = [], []
    for s in plan.seqs:
        if s.sample and len(s.token_ids) == 1:
            decode.append(s.request_id)
        else:
            prefill.append((s.request_id, len(s.token_ids)))
    return StepRecord(
        t=start,
        duration=duration,
        decode=decode,
        prefill=prefill,
        preempted=list(plan.preempted),
        kv_used_blocks=sched.kv.num_used,
        kv_total_blocks=sched.kv.num_blocks,
        waiting=sched.queue.num_requests,
        running=len(sched.running),
        swapped=len(sched.swapped),
    )
