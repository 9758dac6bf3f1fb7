"""Derived scheduler limits that follow served step times: the policy the engine runs online
(server/async_engine.py) and the simulator replays (sim/simulate.py), one class for both.

`LimitsFollower` owns the learner of served step times (sim/cost.py ServedCost) and the limits the
scheduler runs with. It starts from the limits the cost model derives (derive_scheduler_limits),
judges every decoding step by what a running stream waited between two tokens (from one decoding
step's start to the next's: the step, the loop's bookkeeping and the output processing after it),
and once SERVED_MIN_STEPS steps are judged (the served line is fitted), then every
SERVED_DERIVE_STEPS judged steps more, derives null limits again from the served line; it
reports a change when a limit moves by more than LIMITS_TOLERANCE. The scheduler bounds steps by
the served line and a margin for its scatter throughout (`bound`, sim/cost.py ServedBound); a derived
target carries the margin. Explicit limits never move. Pure: the caller passes the step
and its start time, and applies a change to its scheduler.

It always starts from the table as measured, and learns this process's served steps: a document
that carries another run's served line (`GET /debug/cost-model`) says what that run's steps took,
which is how a replay prices its steps (sim/simulate.py), not what this run's will take. A
replay's own steps take that line exactly and do not scatter, so it passes the document's margin
(`margin_floor`) or, where the document dates it, the margin's history (`margin_history`), which
the bound then follows by each step's start on the same clock. `cold_margin`: the margin the bound
keeps, and the limits derived at start carry, until the line is fitted (SERVED_COLD_MARGIN: the
engine's, and a replay's of an engine's document; a plain table's simulation passes none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from magnitude.engine.output import StepPlan
from magnitude.policy.schema import SchedulerPolicy
from magnitude.sim.cost import (SERVED_DERIVE_STEPS, SERVED_MIN_STEPS, CostModel, SchedulerLimits, ServedBound, ServedCost, UnitCost,
                                ceil_target_ms, derive_scheduler_limits, limits_moved, margin_at, measured_model,
                                plan_shape)


def cold_start_limits(sp: SchedulerPolicy, limits: SchedulerLimits, cold_margin: float) -> SchedulerLimits:
    """The limits a follower starts with: derived on the table, and a derived target (none was set)
    raised by the cold start's margin, which the bound keeps until the line is fitted
    (SERVED_COLD_MARGIN): the steps are the table's, the promise what they take at 1 + that margin."""
    if not cold_margin or sp.itl_target_ms is not None or limits.itl_target_ms is None:
        return limits
    return replace(limits, itl_target_ms=ceil_target_ms(limits.itl_target_ms / 1000.0 * (1.0 + cold_margin)))


@dataclass(frozen=True)
class LimitsChange:
    """New limits for the scheduler (Scheduler.set_limits, with the follower's `bound`)."""

    old: SchedulerLimits
    new: SchedulerLimits


class LimitsFollower:
    """The scheduler's limits, derived from `cost`'s table and, for a cost model in seconds, from
    served step times as they are learned (see the module docstring)."""

    def __init__(self, sp: SchedulerPolicy, cost: CostModel | None, margin_floor: float = 0.0,
                 margin_history: Sequence[tuple[float, float]] = (), cold_margin: float = 0.0) -> None:
        self.sp = sp
        table = measured_model(cost)
        self.served = ServedCost(table) if table is not None and not isinstance(table, UnitCost) else None
        # What the scheduler bounds steps by: served step times, for a derived target as for an explicit
        # one. A target is a promise about the steps streams wait on, and a derived one is shown and kept
        # as one (/readyz, the gauges); the served model predicts the table's times until
        # SERVED_EARLY_STEPS steps are judged, then what they take. (Bounded by the table until the limits
        # were first derived again from served steps, the long prompt's chunks beside the chats' decodes
        # took 1.12-1.63x their predictions, about the 196.2 ms target, on a table measured 2 h earlier:
        # bench/results/derived_defaults.md.) The margin is `cold_margin` until SERVED_MIN_STEPS steps are
        # judged (sim/cost.py SERVED_COLD_MARGIN).
        self.bound: CostModel | None = ServedBound(self.served, margin_floor, cold_margin) \
            if self.served is not None else table
        self.margin_history = tuple(margin_history)
        self.limits = cold_start_limits(sp, derive_scheduler_limits(sp, table), cold_margin)
        self._derived_at = 0
        # The last step that ran: (predicted s, start, decodes, whether it carried decodes, the ITL
        # target in ms it was planned under).
        self._previous: tuple[float, float, int, bool, float | None] | None = None
        # The gap the last after_step judged against the ITL target in force, (gap s, target s): what
        # running streams waited from one decoding step's start to the next's, which the target
        # promises; None when that call judged none (no target, or not two decoding steps in a row).
        self.last_itl_gap: tuple[float, float] | None = None

    def after_step(self, plan: StepPlan | None, start: float, decoding: bool,
                   failed: bool = False) -> LimitsChange | None:
        """A step ran from `start` (`decoding`: it carried decodes; None or an empty plan: nothing
        ran, the loop idled; `failed`: requests in it failed, so its time says nothing of what steps
        take, and it counts as an idle call); the change to apply, if any. Two decoding steps back to
        back are judged on the line (a decoding step leaves work, so the loop does not idle in
        between), and a prefill-only step followed by any step is judged for the prefill-only ratio
        (its prompt goes on or starts decoding); an idle call breaks the chain."""
        served = self.served
        if served is None:
            return None
        ran = plan is not None and bool(plan.seqs) and not failed
        self.last_itl_gap = None
        if ran and self._previous is not None:
            predicted, previous_start, decodes, was_decoding, target_ms = self._previous
            if was_decoding and decoding:
                served.observe(predicted, start - previous_start, decodes, at=start)
                if target_ms is not None:
                    self.last_itl_gap = (start - previous_start, target_ms / 1000.0)
            elif not was_decoding:
                served.observe_prefill_only(predicted, start - previous_start)
        if self.margin_history and isinstance(self.bound, ServedBound):
            self.bound.margin_floor = margin_at(self.margin_history, start)
        self._previous = (served.model.step_seconds(plan), start, plan_shape(plan, 0)[0], decoding,
                          self.limits.itl_target_ms) if ran and plan is not None else None
        due = SERVED_MIN_STEPS if self._derived_at == 0 else self._derived_at + SERVED_DERIVE_STEPS
        if served.steps < due:
            return None
        self._derived_at = served.steps
        old = self.limits
        if old.source != "derived":
            return None
        new = derive_scheduler_limits(self.sp, self.bound)
        if not limits_moved(old, new):
            return None
        self.limits = new
        return LimitsChange(old, new)
