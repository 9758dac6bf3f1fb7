"""The scheduler's per-step ITL bound (`itlTargetMs` with a cost model): prefill takes what the
decodes leave, across every chunk of the step; admission waits in order when nothing is left; steps
without decodes are not bounded (nobody waits for a next token)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from magnitude.engine.scheduler import ITL_PREFILL_FLOOR, Scheduler
from magnitude.policy.load import resolve_config

from sched_helpers import fake_output, make_request, shape


@dataclass(frozen=True)
class Affine:
    """A cost model stand-in with round numbers: 10 ms a step, 5 ms a decode, 1 ms a prefill token
    (no attention terms: where the tokens sit does not matter)."""

    def seconds_for(self, decodes: int, prefill_tokens: int, swapped_tokens: int = 0, attention=None) -> float:
        return 0.010 + 0.005 * decodes + 0.001 * prefill_tokens


def scheduler(*sets: str) -> Scheduler:
    return Scheduler(resolve_config(None, ["kvCache.numBlocks=512", *sets]), cost_model=Affine())


def decoding(s: Scheduler, n: int) -> None:
    """n requests that have finished their prompts and now decode, one per step."""
    for i in range(n):
        s.add_request(make_request(f"d{i}", 8, 50), 0.0)
    plan = s.schedule(0.0)
    assert all(sampled for _, _, sampled in shape(plan))
    s.update_from_output(plan, fake_output(plan), 0.1)


def predicted(plan) -> float:
    decodes = sum(1 for s in plan.seqs if s.sample and s.num_tokens == 1)
    return Affine().seconds_for(decodes, plan.num_tokens - decodes)


def test_prefill_takes_what_the_decodes_leave_across_all_chunks() -> None:
    s = scheduler("scheduler.tokenBudget=4096", "scheduler.prefillChunkSize=1000", "scheduler.itlTargetMs=100")
    decoding(s, 4)  # 10 + 4 * 5 = 30 ms: 70 prefill tokens left in a 100 ms step
    for i in range(3):
        s.add_request(make_request(f"p{i}", 500, 4), 1.0)
    plan = s.schedule(1.0)
    chunks = [(rid, n) for rid, n, sampled in shape(plan) if not rid.startswith("d")]
    assert sum(n for _, n in chunks) == 70, chunks  # all the prompts together, not each one
    assert predicted(plan) == pytest.approx(0.100)
    events = [(e.kind, e.reason) for e in s.drain_events()]
    assert ("defer", "itl_target") in events  # the next prompt waits for room, in order


def test_without_the_target_the_chunks_fill_the_budget() -> None:
    """The peer: the same step with only the per-sequence chunk cap runs to 1,530 ms."""
    s = scheduler("scheduler.tokenBudget=4096", "scheduler.prefillChunkSize=1000")
    decoding(s, 4)
    for i in range(3):
        s.add_request(make_request(f"p{i}", 500, 4), 1.0)
    plan = s.schedule(1.0)
    assert predicted(plan) == pytest.approx(0.030 + 1.5)


def test_decodes_that_use_the_whole_target_leave_no_prefill_but_keep_decoding() -> None:
    s = scheduler("scheduler.itlTargetMs=40")
    decoding(s, 6)  # 10 + 30 = 40 ms: nothing left
    s.add_request(make_request("late", 100, 4), 1.0)
    plan = s.schedule(1.0)
    assert [rid for rid, _, _ in shape(plan)] == [f"d{i}" for i in range(6)]
    assert s.get_request("late").status.value == "waiting"


def test_decodes_that_alone_miss_the_target_still_let_a_little_prefill_in() -> None:
    """A machine slower than the target: the step is late whatever it carries, so prefill gets
    ITL_PREFILL_FLOOR tokens rather than waiting for every running request to finish."""
    s = scheduler("scheduler.prefillChunkSize=1000", "scheduler.itlTargetMs=30")
    decoding(s, 6)  # 40 ms > 30 ms
    s.add_request(make_request("late", 100, 4), 1.0)
    s.add_request(make_request("later", 100, 4), 1.0)
    plan = s.schedule(1.0)
    chunks = [(rid, n) for rid, n, _ in shape(plan) if not rid.startswith("d")]
    assert chunks == [("late", ITL_PREFILL_FLOOR)]  # the floor is per step, not per request
    assert s.get_request("later").status.value == "waiting"


def test_a_step_without_decodes_is_not_bounded() -> None:
    s = scheduler("scheduler.tokenBudget=4096", "scheduler.prefillChunkSize=1000", "scheduler.itlTargetMs=100")
    s.add_request(make_request("p", 800, 4), 0.0)
    assert shape(s.schedule(0.0)) == [("p", 800, True)]


def test_a_last_prompt_token_counts_as_a_decode() -> None:
    """A one-token chunk that samples is shaped as a decode (5 ms, not 1 ms): it fits only if that does."""
    s = scheduler("scheduler.prefillChunkSize=1000", "scheduler.itlTargetMs=44")
    decoding(s, 6)  # 40 ms
    s.add_request(make_request("one", 1, 4), 1.0)  # its whole prompt is its last token: 45 ms > 44
    plan = s.schedule(1.0)
    assert "one" not in [rid for rid, _, _ in shape(plan)] and predicted(plan) <= 0.044


def test_a_target_without_a_cost_model_is_refused() -> None:
    with pytest.raises(ValueError, match="itlTargetMs"):
        Scheduler(resolve_config(None, ["kvCache.numBlocks=64", "scheduler.itlTargetMs=100"]))


def test_new_limits_shape_the_next_steps_and_keep_the_requests() -> None:
    """set_limits (the engine's derived limits, derived again from served steps): the next step
    takes the new target and chunk; requests in flight carry on; bad limits are refused."""
    s = scheduler("scheduler.tokenBudget=4096", "scheduler.prefillChunkSize=1000", "scheduler.itlTargetMs=100")
    decoding(s, 4)
    s.add_request(make_request("p", 500, 4), 1.0)
    plan = s.schedule(1.0)
    assert dict((rid, n) for rid, n, _ in shape(plan))["p"] == 70  # 100 ms - 30 ms of decodes
    s.update_from_output(plan, fake_output(plan), 1.1)
    s.set_limits(64, 20, 200.0, Affine())
    plan = s.schedule(1.2)
    assert dict((rid, n) for rid, n, _ in shape(plan))["p"] == 20  # the new chunk, under the new target
    assert plan.num_tokens <= 64 and s.token_budget == 64 and s.itl_target_s == 0.2
    s.update_from_output(plan, fake_output(plan), 1.3)
    assert s.get_request("p").num_computed_tokens == 90
    with pytest.raises(ValueError, match="at least 1"):
        s.set_limits(0, 20, None, Affine())
    with pytest.raises(ValueError, match="itlTargetMs"):
        s.set_limits(64, 20, 100.0, None)
