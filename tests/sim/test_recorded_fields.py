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


def test_a_deadline_that_ends_the_last_work_is_not_a_stall() -> None:
    # The long request holds the only sequence slot; the short one's deadline passes during the long
    # one's last step. The step after it expires the short one and is empty with nothing left: the
    # run ends there instead of raising "scheduler stalled".
    cfg = EngineConfig.model_validate({"scheduler": {"tokenBudget": 64, "prefillChunkSize": 64, "maxSequences": 1}})
    long = TraceRecord(id="long", arrival=0.0, prompt_tokens=4000, output_tokens=1)
    end = simulate([long], cfg, LinearCost()).end_time
    short = TraceRecord(id="short", arrival=0.0, prompt_tokens=8, output_tokens=1, deadline=end - 0.001)
    result = simulate([long, short], cfg, LinearCost())
    status = {rec.id: req.status.value for rec, req in result.requests}
    assert status == {"long": "finished", "short": "timed_out"}
