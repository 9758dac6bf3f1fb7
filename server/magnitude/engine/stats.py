"""A snapshot of the scheduler's state and cumulative counters, for metrics and reports.

The Prometheus adapter (server) and the simulator read this dataclass; nothing here
knows about either. Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SchedulerStats:
    step_id: int
    running: int
    waiting: int
    swapped: int
    kv_used_blocks: int
    kv_total_blocks: int
    kv_cached_free_blocks: int
    swap_used_blocks: int
    swap_total_blocks: int
    queued_tokens: int
    shedding: bool
    # Estimates the admission uses (None until a step has been observed).
    drain_tokens_per_s: float | None
    step_seconds: float | None
    # Cumulative counters since start.
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    preemptions: dict[tuple[str, str], int] = field(default_factory=dict)  # (mode, reason) -> n
    rejections: dict[str, int] = field(default_factory=dict)  # reason -> n
    finished: dict[str, int] = field(default_factory=dict)  # terminal status -> n
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_alloc_failures: int = 0

    @property
    def kv_usage_ratio(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0
