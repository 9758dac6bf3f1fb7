"""The real Scheduler driving the real ModelRunner (a synchronous loop, virtual time).

Equality with HF `generate` must survive the scheduler's own chunking, batching and preemption:
a KV pool far too small for all six prompts forces preemption by recompute and by swap. Every
device and host block must be free at the end.
"""

from __future__ import annotations

import pytest

from magnitude.engine.sampling import SamplingParams

from .conftest import MAX_NEW, drive_scheduler, without_eos

pytestmark = pytest.mark.model


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_scheduler_and_runner_match_hf_under_preemption(runner, prompt_ids, hf_reference, mode):
    run = drive_scheduler(
        runner, prompt_ids, SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
        f"scheduler.preemptionMode={mode}",
        "scheduler.prefillChunkSize=16",
        "scheduler.tokenBudget=64",
        "kvCache.numBlocks=12",
        f"kvCache.swapBlocks={runner.num_swap_blocks}",
        "kvCache.enablePrefixCaching=false",
    )
    expected = {f"r{i}": without_eos(ref, runner.eos_token_ids) for i, ref in enumerate(hf_reference)}
    assert run.outputs == expected
    assert set(run.finished) == set(run.outputs), run.finished
    stats = run.sched.stats()
    assert sum(n for (m, _reason), n in stats.preemptions.items() if m == mode) > 0, stats.preemptions
