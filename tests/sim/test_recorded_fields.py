"""Recorded-trace fields in the simulator: a request reaches the queue after its preparation while
its arrival (TTFT, e2e) stays the HTTP one; prefix groups become prefix-cache hits."""

from __future__ import annotations

from magnitude.policy.schema import EngineConfig
from magnitude.sim.cost import LinearCost
from magnitude.sim.simulate import simulate
from magnitude.sim.trace import TraceRecord


def test_preparation_delays_the_queue_not_the_arrival() -> None:
    recs = [TraceRecord(id="a", arrival=1.0, prompt_tokens=32, output_tokens=2, preparation=0.5)]
    (_, req), = simulate(recs, EngineConfig(), LinearCost()).requests
    assert req.arrival_time == 1.0 and req.admitted_time == 1.5
    assert req.first_token_time > 1.5


def test_a_cancel_during_preparation_still_cancels() -> None:
    recs = [TraceRecord(id="a", arrival=1.0, prompt_tokens=32, output_tokens=50, preparation=0.5, cancel_at=1.2)]
    (_, req), = simulate(recs, EngineConfig(), LinearCost()).requests
    assert req.status.value == "cancelled"


def test_shared_prefix_groups_are_cache_hits_and_others_are_not() -> None:
    groups = ["a1", "a2", "a3"]  # 1, 2 and 4 blocks of 16
    recs = [
        TraceRecord(id="first", arrival=0.0, prompt_tokens=80, output_tokens=2, prefix_groups=groups, prefix_block_size=16),
        TraceRecord(id="same", arrival=5.0, prompt_tokens=80, output_tokens=2, prefix_groups=groups, prefix_block_size=16),
        TraceRecord(id="other", arrival=6.0, prompt_tokens=80, output_tokens=2, prefix_groups=["b1", "b2", "b3"],
                    prefix_block_size=16),
        TraceRecord(id="plain", arrival=7.0, prompt_tokens=80, output_tokens=2),
    ]
    cached = {rec.id: req.num_cached_tokens for rec, req in simulate(recs, EngineConfig(), LinearCost()).requests}
    assert cached == {"first": 0, "same": 64, "other": 0, "plain": 0}
