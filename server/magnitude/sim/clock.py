"""A virtual clock over an event heap (SimPy's kernel, reduced to what the simulator needs).

Entries are `(time, priority, seq, kind, payload)`: equal times pop by priority, then FIFO, so
ties are deterministic. Time only moves forward. Pure: no wall-clock reads.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

# Tie order at the same instant: a step's tokens land before cancellations, which land before
# arrivals; then the next step starts.
STEP_END, CANCEL, ARRIVAL = 0, 1, 2


class EventHeap:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self.now = 0.0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, time: float, priority: int, payload: Any) -> None:
        if time < self.now:
            raise ValueError(f"event at {time} is in the past (now {self.now})")
        heapq.heappush(self._heap, (time, priority, next(self._seq), payload))

    def pop(self) -> tuple[float, int, Any]:
        time, priority, _, payload = heapq.heappop(self._heap)
        self.now = time
        return time, priority, payload

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None
