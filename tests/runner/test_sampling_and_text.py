"""Sampling, logprobs, drafts, per-request failure, detokenization and stop strings on the real model."""

from __future__ import annotations

import pytest

from magnitude.engine.output import ScheduledSeq, StepPlan
from magnitude.engine.sampling import SamplingParams
from magnitude.runner.detokenize import IncrementalDetokenizer
from magnitude.server.output_processor import StopMatcher

from .conftest import MAX_NEW, ToySeq, greedy

pytestmark = pytest.mark.model


def _run(driver_factory, prompt_ids, params: list[SamplingParams], max_new: int = MAX_NEW) -> list[list[int]]:
    seqs = [ToySeq(f"s{i}", ids, p) for i, (ids, p) in enumerate(zip(prompt_ids, params))]
    driver_factory().run(seqs, max_new)
    return [s.out for s in seqs]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(driver_factory, prompt_ids):
    hot = SamplingParams(max_tokens=MAX_NEW, temperature=1.2, top_p=0.95, seed=1234, ignore_eos=True)
    alone = _run(driver_factory, prompt_ids[2:3], [hot])[0]
    again = _run(driver_factory, prompt_ids[2:3], [hot])[0]
    # Same request among other (unseeded, random) requests in the same steps.
    others = [SamplingParams(max_tokens=MAX_NEW, temperature=1.0, ignore_eos=True) for _ in range(3)]
    mixed = _run(driver_factory, [prompt_ids[0], prompt_ids[2], prompt_ids[4], prompt_ids[5]],
                 [others[0], hot, others[1], others[2]])[1]
    assert alone == again == mixed
    other_seed = SamplingParams(max_tokens=MAX_NEW, temperature=1.2, top_p=0.95, seed=99, ignore_eos=True)
    assert _run(driver_factory, prompt_ids[2:3], [other_seed])[0] != alone


def test_top_k_one_is_greedy_and_logprobs_are_consistent(driver_factory, prompt_ids, hf_reference):
    p = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_k=1, logprobs=3)
    seqs = [ToySeq("k1", prompt_ids[3], p)]
    driver_factory().run(seqs, MAX_NEW)
    assert seqs[0].out == hf_reference[3]
    for tok in seqs[0].logprobs:
        assert tok.logprob is not None and tok.logprob <= 0.0
        top_ids = [t for t, _ in tok.top_logprobs]
        top_lps = [lp for _, lp in tok.top_logprobs]
        assert len(top_ids) == 3 and top_lps == sorted(top_lps, reverse=True)
        assert top_ids[0] == tok.token_id and top_lps[0] == pytest.approx(tok.logprob)


class _OracleDrafts:
    """Proposes the known greedy continuation, optionally corrupted at one draft index."""

    def __init__(self, continuation: list[int], prompt_len: int, wrong_at: int | None) -> None:
        self.cont, self.prompt_len, self.wrong_at = continuation, prompt_len, wrong_at

    def propose(self, seq: ScheduledSeq, k: int) -> list[int]:
        done = seq.start_position + len(seq.token_ids) - self.prompt_len  # outputs already known
        drafts = self.cont[done : done + k]
        if self.wrong_at is not None and self.wrong_at < len(drafts):
            drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % 1000
        return drafts


@pytest.mark.parametrize("wrong_at", [None, 1])
def test_draft_lookahead_hook_keeps_greedy_output(runner, prompt_ids, hf_reference, wrong_at):
    ids, ref = prompt_ids[4], hf_reference[4]
    bs = runner.block_size
    table = list(range(40, 40 + (len(ids) + MAX_NEW + 4) // bs + 1))
    runner.draft_proposer = _OracleDrafts(ref, len(ids), wrong_at)
    try:
        out = runner.execute(StepPlan(0, [ScheduledSeq("d", ids, 0, table, True, greedy())]))
        got = [t.token_id for t in out.sampled["d"]]
        steps = 1
        while len(got) < len(ref):
            seq = ScheduledSeq("d", [got[-1]], len(ids) + len(got) - 1, table, True, greedy(),
                               num_output_tokens=len(got), num_lookahead=3)
            new = [t.token_id for t in runner.execute(StepPlan(steps, [seq])).sampled["d"]]
            assert 1 <= len(new) <= 4
            got += new
            steps += 1
    finally:
        runner.draft_proposer = None
    assert got[: len(ref)] == ref
    if wrong_at is None:
        assert steps < len(ref)  # drafts were accepted: fewer steps than tokens


def test_a_bad_request_fails_alone(runner, prompt_ids):
    good = ScheduledSeq("good", prompt_ids[1], 0, [60], True, greedy())
    bad_token = ScheduledSeq("bad_token", [runner.vocab_size + 5], 0, [61], True, greedy())
    short_table = ScheduledSeq("short_table", prompt_ids[5], 0, [62], True, greedy())
    out = runner.execute(StepPlan(0, [good, bad_token, short_table]))
    assert set(out.failed) == {"bad_token", "short_table"}
    assert "token id" in out.failed["bad_token"] and "block table" in out.failed["short_table"]
    assert list(out.sampled) == ["good"]


def test_detokenizer_never_splits_multibyte_characters(runner):
    tok = runner.tokenizer
    text = "Crème brûlée 🍮 costs 5€ — 日本語のテキスト 👩‍💻!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok)
    deltas = [d.push(t) for t in ids]
    deltas.append(d.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)
    assert any(x == "" for x in deltas[:-1])  # some character really did span several tokens


@pytest.mark.parametrize("stop", ["Paris", " is", "e c", "."])
def test_stop_strings_cut_exactly(runner, stop):
    tok = runner.tokenizer
    text = "The capital of France is Paris. It is a city of light."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d, m = IncrementalDetokenizer(tok), StopMatcher([stop, "never-there"])
    emitted = ""
    for t in ids:
        emitted += m.feed(d.push(t))
        if m.stopped:
            break
    assert m.stopped and emitted == text[: text.index(stop)]


def test_one_unsampleable_row_fails_only_its_request(runner, prompt_ids):
    """NaN logits in one row (a broken model output, injected by a hook on the LM head) fail that
    request; the greedy and random rows beside it are sampled, and so is a temperature too small
    to represent, which is greedy."""
    poisoned_row = 2

    def poison(module, inputs, output):
        output = output.clone()
        output[poisoned_row, 7] = float("nan")
        return output

    seqs = [
        ScheduledSeq("greedy", prompt_ids[1], 0, [70], True, greedy()),
        ScheduledSeq("tiny_temperature", prompt_ids[1], 0, [71], True, SamplingParams(max_tokens=4, temperature=1e-40)),
        ScheduledSeq("poisoned", prompt_ids[1], 0, [72], True, SamplingParams(max_tokens=4, temperature=1.0)),
        ScheduledSeq("random", prompt_ids[1], 0, [73], True, SamplingParams(max_tokens=4, temperature=1.0, top_p=1e-12)),
    ]
    handle = runner.model.lm_head.register_forward_hook(poison)
    try:
        out = runner.execute(StepPlan(0, seqs))
    finally:
        handle.remove()
    assert set(out.failed) == {"poisoned"} and "NaN" in out.failed["poisoned"]
    assert set(out.sampled) == {"greedy", "tiny_temperature", "random"}
    top = out.sampled["greedy"][0].token_id
    assert out.sampled["tiny_temperature"][0].token_id == top
    assert out.sampled["random"][0].token_id == top  # top_p 1e-12: the nucleus is the top token
