"""Scheduler decisions as data: one event per decision, each with a reason.

The scheduler appends events as it decides; the engine (metrics, logs) and the simulator
(report) drain them. Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# "shed" is the one kind the scheduler never emits: the engine records a change of the shed set
# (an operator's decision, with no request) in the same decision log.
EventKind = Literal[
    "admit", "defer", "preempt", "reject", "release", "swap_out", "swap_in", "finish", "cancel", "timeout", "shed"
]
EVENT_KINDS: tuple[str, ...] = (
    "admit", "defer", "preempt", "reject", "release", "swap_out", "swap_in", "finish", "cancel", "timeout", "shed",
)


@dataclass(slots=True)
class SchedulerEvent:
    t: float
    kind: EventKind
    request_id: str
    reason: str
    detail: dict = field(default_factory=dict)

    def to_document(self) -> dict:
        """The report's event shape."""
        return {"t": self.t, "kind": self.kind, "request": self.request_id, "reason": self.reason}
