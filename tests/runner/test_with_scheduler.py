"""The real Scheduler driving the real ModelRunner (a synchronous loop, virtual time).

Equality with HF `generate` must survive the scheduler's own chunking, batching and preemption:
a KV pool far too small for all six prompts forces preemption by recompute and by swap. Every
device and host block must be free at the end.
"""

from __future__ import annotations

import pytest

from magnitude.engine.request import Request
from magnitude.engine.sampling import SamplingParams
from magnitude.engine.scheduler import Scheduler
from magnitude.policy.load import resolve_config

from .conftest import MAX_NEW

pytestmark = pytest.mark.model


def _drive(runner, prompt_ids, *sets: str) -> tuple[Scheduler, dict[str, list[int]]]:
    sched = Scheduler(resolve_config(None, list(sets)))
    now = 0.0
    for i, ids in enumerate(prompt_ids):
        req = Request(f"r{i}", list(ids), len(ids), SamplingParams(max_tokens=MAX_NEW, temperature=0.0), now,
                      eos_token_ids=runner.eos_token_ids)
        assert sched.add_request(req, now).accepted
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompt_ids))}
    finished: dict[str, str | None] = {}
    steps = 0
    while sched.has_work():
        plan = sched.schedule(now)
        out = runner.execute(plan)
        assert not out.failed, out.failed
        now += 1.0
        for u in sched.update_from_output(plan, out, now):
            outputs[u.request_id].extend(u.new_token_ids)
            if u.finished:
                finished[u.request_id] = u.finish_reason
        steps += 1
        assert steps < 500, "scheduler + runner did not converge"
    assert set(finished) == set(outputs), finished
    return sched, outputs


def _without_eos(ref: list[int], eos: list[int]) -> list[int]:
    return ref[:-1] if ref and ref[-1] in eos else ref


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_scheduler_and_runner_match_hf_under_preemption(runner, prompt_ids, hf_reference, mode):
    sched, outputs = _drive(
        runner, prompt_ids,
        f"scheduler.preemptionMode={mode}",
        "scheduler.prefillChunkSize=16",
        "scheduler.tokenBudget=64",
        "kvCache.numBlocks=12",
        f"kvCache.swapBlocks={runner.num_swap_blocks}",
        "kvCache.enablePrefixCaching=false",
    )
    expected = {f"r{i}": _without_eos(ref, runner.eos_token_ids) for i, ref in enumerate(hf_reference)}
    assert outputs == expected
    stats = sched.stats()
    assert sum(n for (m, _reason), n in stats.preemptions.items() if m == mode) > 0, stats.preemptions
    assert stats.kv_used_blocks == 0 and stats.swap_used_blocks == 0
    assert stats.running == stats.waiting == stats.swapped == 0
