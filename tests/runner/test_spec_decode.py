"""Speculative decoding by prompt lookup on the real model, driven by the real scheduler.

Greedy verification must give exactly the tokens of non-speculative decoding (HF `generate`
references from the conftest) under chunking, preemption by recompute and by swap, and
cancellation; on a copy-heavy prompt most drafts must be accepted. Seeded sampling must give the
same tokens with speculation on and off (runner/sampling.py `Sampler.verify`).
"""

from __future__ import annotations

import contextlib

import pytest

from magnitude.engine.request import Request
from magnitude.engine.sampling import SamplingParams
from magnitude.engine.scheduler import Scheduler
from magnitude.runner.spec_decode import NgramProposer

from .conftest import MAX_NEW, drive_scheduler, without_eos

pytestmark = pytest.mark.model

SPEC = ("draftModel.method=ngram", "draftModel.mode=on", "draftModel.numSpeculativeTokens=4")

PASSAGE = ("The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp, and wrote the "
           "weather in his logbook: wind from the west, light rain, three ships sighted before nightfall.")
COPY_PROMPT = f"Copy the passage exactly.\n\nPassage: {PASSAGE}\n\nCopy: {PASSAGE}\n\nCopy again: The lighthouse"


@contextlib.contextmanager
def _proposer(runner, proposer):
    runner.draft_proposer = proposer
    try:
        yield
    finally:
        runner.draft_proposer = None


def _drive(runner, prompts: list[list[int]], sampling: SamplingParams, *sets: str,
           cancel: tuple[str, int] | None = None) -> tuple[Scheduler, dict[str, list[int]], dict[str, Request], int]:
    run = drive_scheduler(runner, prompts, sampling, *sets, cancel=cancel)
    return run.sched, run.outputs, run.reqs, run.steps


_without_eos = without_eos


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prompt_lookup_greedy_matches_hf_under_chunking_and_preemption(runner, prompt_ids, hf_reference, mode):
    # Unigram matches: the short generic prompts then get drafts, most of them rejected.
    with _proposer(runner, NgramProposer(min_ngram=1)):
        sched, outputs, reqs, _ = _drive(
            runner, prompt_ids, _greedy(), *SPEC,
            f"scheduler.preemptionMode={mode}", "scheduler.prefillChunkSize=16", "scheduler.tokenBudget=64",
            "kvCache.numBlocks=12", f"kvCache.swapBlocks={runner.num_swap_blocks}", "kvCache.enablePrefixCaching=false",
        )
    expected = {f"r{i}": _without_eos(ref, runner.eos_token_ids) for i, ref in enumerate(hf_reference)}
    assert outputs == expected
    assert sum(n for (m, _), n in sched.stats().preemptions.items() if m == mode) > 0
    assert sum(r.spec_proposed for r in reqs.values()) > 0, "no drafts were proposed: speculation never ran"
    assert all(r.num_lookahead == 4 for r in reqs.values())


def test_prompt_lookup_cancellation_frees_blocks_and_keeps_the_others(runner, prompt_ids, hf_reference):
    with _proposer(runner, NgramProposer(min_ngram=1)):
        _, outputs, reqs, _ = _drive(runner, prompt_ids, _greedy(), *SPEC, "scheduler.prefillChunkSize=16",
                                     cancel=("r2", 4))
    assert reqs["r2"].status.name == "CANCELLED"
    for i, ref in enumerate(hf_reference):
        if i != 2:
            assert outputs[f"r{i}"] == _without_eos(ref, runner.eos_token_ids)
    assert outputs["r2"] == hf_reference[2][: len(outputs["r2"])]
    assert sum(r.spec_proposed for r in reqs.values()) > 0


def test_prompt_lookup_on_a_copy_heavy_prompt_accepts_most_drafts(runner):
    ids = runner.tokenizer(COPY_PROMPT)["input_ids"]
    want = 24
    ref = runner.greedy_tokens([ids], want)[0]
    sampling = SamplingParams(max_tokens=want, temperature=0.0)
    _, plain, _, plain_steps = _drive(runner, [ids], sampling)
    with _proposer(runner, NgramProposer()):
        _, spec, reqs, spec_steps = _drive(runner, [ids], sampling, *SPEC)
    assert plain["r0"] == spec["r0"] == _without_eos(ref, runner.eos_token_ids)
    r = reqs["r0"]
    assert r.spec_proposed > 0 and r.spec_accepted / r.spec_proposed > 0.6, (r.spec_accepted, r.spec_proposed)
    assert spec_steps < plain_steps - want // 3  # several tokens landed per step


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(runner):
    ids = runner.tokenizer(COPY_PROMPT)["input_ids"]
    sampling = SamplingParams(max_tokens=20, temperature=0.7, top_p=0.95, seed=1234)
    _, plain, _, _ = _drive(runner, [ids, ids], sampling)
    with _proposer(runner, NgramProposer()):
        _, spec, reqs, _ = _drive(runner, [ids, ids], sampling, *SPEC)
    assert spec == plain
    assert plain["r0"] == plain["r1"]
    assert sum(r.spec_accepted for r in reqs.values()) > 0


class _Broken:
    def propose(self, seq, k):
        raise RuntimeError("proposer bug")


def test_a_failing_proposer_costs_the_drafts_not_the_request(runner, prompt_ids, hf_reference):
    with _proposer(runner, _Broken()):
        _, outputs, reqs, _ = _drive(runner, prompt_ids[:2], _greedy(), *SPEC)
    assert outputs == {f"r{i}": _without_eos(hf_reference[i], runner.eos_token_ids) for i in range(2)}
    assert all(r.spec_proposed == 0 for r in reqs.values())
