"""Speculative decoding under a grammar mask and with penalties, on the real model (issue 14).

The contract: with a grammar (structured outputs) rejected drafts roll the grammar state back, and
penalties count verified tokens only; so the output equals non-speculative decoding token for
token (greedy, and seeded sampling), also while the `auto` policy switches drafting on and off
mid-request. Each comparison also checks that drafts were proposed (and, where it matters,
rejected), so a run where speculation silently never happened cannot pass.
"""

from __future__ import annotations

import json

import pytest

from magnitude.engine.request import Request
from magnitude.engine.sampling import SamplingParams
from magnitude.engine.scheduler import Scheduler
from magnitude.engine.speculation import SpeculationPolicy
from magnitude.policy.load import resolve_config
from magnitude.runner.constraints import advance_through_drafts, settle_drafts
from magnitude.runner.spec_decode import NgramProposer
from magnitude.server.structured import Grammars, OutputContract

from .test_spec_decode import SPEC, _drive, _proposer

pytestmark = pytest.mark.model

RECORD = {"name": "Ada Lovelace", "city": "London", "field": "mathematics", "born": 1815}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                           "field": {"type": "string"}, "born": {"type": "integer"}},
          "required": ["name", "city", "field", "born"], "additionalProperties": False}
# The answer repeats the prompt's record: prompt lookup drafts most of it.
JSON_PROMPT = (f"Record: {json.dumps(RECORD)}\nThe same record again, as JSON: ")
PENALTY_PROMPT = ("The lighthouse keeper climbed the stairs, lit the lamp and wrote the weather in the log. "
                  "The lighthouse keeper climbed the stairs, lit the lamp and wrote the weather in the")


class _Stutter:
    """Prompt lookup with its first draft repeated: the second draft is usually wrong (rejected,
    so the grammar rolls back) and sometimes one the grammar refuses (the proposal ends there)."""

    def propose(self, seq, k: int) -> list[int]:
        drafts = NgramProposer().propose(seq, k)
        return (drafts[:1] + drafts)[:k]


PROPOSERS = {"bigram": NgramProposer(), "unigram": NgramProposer(min_ngram=1), "stutter": _Stutter()}


@pytest.fixture(scope="module")
def grammars(runner) -> Grammars:
    return Grammars(runner.tokenizer, runner.vocab_size, list(runner.eos_token_ids))


def _constrained(grammars: Grammars, **kw) -> SamplingParams:
    return SamplingParams(constraint=grammars.constraint(OutputContract("json_schema", SCHEMA)), **kw)


def _bits(matcher, vocab: int) -> list[int]:
    import xgrammar

    mask = xgrammar.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(mask, 0)
    return mask[0].tolist()


def test_settled_drafts_leave_the_matcher_as_accepting_only_the_kept_tokens(runner, grammars):
    text = runner.tokenizer(json.dumps(RECORD))["input_ids"]
    walked, fresh = _constrained(grammars), _constrained(grammars)
    for t in text[:3]:
        assert walked.constraint.accept_token(t) and fresh.constraint.accept_token(t)
    drafts = text[3:8]
    kept, mask = advance_through_drafts(walked, drafts, runner.vocab_size)
    assert kept == drafts and mask.shape[0] == len(drafts) + 1
    # Verification kept two drafts, then emitted its own token (one the grammar allows there).
    correction = next(t for t in range(runner.vocab_size) if t != drafts[2] and (int(mask[2, t // 32]) >> (t % 32)) & 1)
    settle_drafts(walked, len(kept), [*drafts[:2], correction])
    for t in [*drafts[:2], correction]:
        assert fresh.constraint.accept_token(t)
    assert _bits(walked.constraint, runner.vocab_size) == _bits(fresh.constraint, runner.vocab_size)
    # A draft the grammar refuses ends the proposal, and so does the stop token that would end
    # the grammar; the matcher stands after the kept drafts.
    last = _constrained(grammars)
    for t in text[:-1]:
        assert last.constraint.accept_token(t)
    refused = runner.tokenizer(" not json")["input_ids"]
    kept, mask = advance_through_drafts(last, [text[-1], *refused], runner.vocab_size)
    assert kept == [text[-1]] and mask.shape[0] == 2 and last.constraint.is_completed()
    kept, mask = advance_through_drafts(last, [runner.eos_token_ids[0]], runner.vocab_size)
    assert kept == [] and mask.shape[0] == 1 and not last.constraint.is_terminated()


@pytest.mark.parametrize("name", ["bigram", "stutter"])
def test_greedy_json_schema_under_speculation_equals_without(runner, grammars, name):
    ids = runner.tokenizer(JSON_PROMPT)["input_ids"]
    plain_sched, plain, _, _ = _drive(runner, [ids], _constrained(grammars, max_tokens=40, temperature=0.0))
    with _proposer(runner, PROPOSERS[name]):
        _, spec, reqs, _ = _drive(runner, [ids], _constrained(grammars, max_tokens=40, temperature=0.0), *SPEC)
    assert spec == plain
    r = reqs["r0"]
    assert r.num_lookahead == 4 and r.spec_accepted > 0, (r.spec_proposed, r.spec_accepted)
    if name == "stutter":
        assert r.spec_proposed > r.spec_accepted, "no draft was rejected: the rollback never ran"
    text = runner.tokenizer.decode(spec["r0"], skip_special_tokens=True)
    assert json.loads(text) == json.loads(runner.tokenizer.decode(plain["r0"], skip_special_tokens=True))


@pytest.mark.parametrize("penalties", [
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 0.6, "presence_penalty": 0.4, "logit_bias": {13: 2.0}},
])
def test_greedy_penalties_under_speculation_equal_without(runner, penalties):
    ids = runner.tokenizer(PENALTY_PROMPT)["input_ids"]
    sampling = SamplingParams(max_tokens=24, temperature=0.0, **penalties)
    _, plain, _, _ = _drive(runner, [ids], sampling)
    with _proposer(runner, PROPOSERS["unigram"]):
        _, spec, reqs, _ = _drive(runner, [ids], sampling, *SPEC)
    assert spec == plain
    r = reqs["r0"]
    assert r.spec_proposed > 0 and r.num_lookahead == 4


def _drive_auto(runner, prompt: list[int], sampling: SamplingParams,
                decisions: list[bool] | None) -> tuple[list[int], Request]:
    """Scheduler + runner with the auto policy deciding each step, its decisions appended to
    `decisions` (None: no speculation configured). The policy is fed step costs that make it switch often: drafted steps look
    slow while acceptance is low and fast while it is high, so drafting turns off and on again."""
    auto = ["draftModel.method=ngram", "draftModel.mode=auto", "draftModel.numSpeculativeTokens=4"]
    sets = [f"kvCache.numBlocks={runner.num_blocks}", *(auto if decisions is not None else [])]
    sched = Scheduler(resolve_config(None, sets))
    policy = SpeculationPolicy("auto", min_samples=1, probe_every=2)
    req = Request("r0", list(prompt), len(prompt), sampling, 0.0, eos_token_ids=runner.eos_token_ids)
    assert sched.add_request(req, 0.0).accepted
    got: list[int] = []
    now, step = 0.0, 0
    while sched.has_work():
        plan = sched.schedule(now)
        out = runner.execute(plan)
        assert not out.failed, out.failed
        now += 1.0
        for u in sched.update_from_output(plan, out, now):
            got.extend(u.new_token_ids)
        if decisions is not None:
            drafted = bool(out.num_drafts)
            tokens = sum(len(v) for v in out.sampled.values())
            # a drafted step "costs" 4.5 plain steps: it pays only when all 4 drafts and the bonus land
            on = policy.observe(4.5 if drafted else 1.0, 1, tokens, prefill=step == 0, drafted=drafted)
            sched.set_speculation(on)
            decisions.append(on)
        step += 1
        assert step < 300
    return got, req


def test_seeded_sampling_with_grammar_and_penalties_is_reproducible_under_auto(runner, grammars):
    ids = runner.tokenizer(JSON_PROMPT)["input_ids"]
    params = dict(max_tokens=40, temperature=0.8, top_p=0.95, seed=77, frequency_penalty=0.3)
    plain, _ = _drive_auto(runner, ids, _constrained(grammars, **params), None)
    decisions: list[bool] = []
    with _proposer(runner, PROPOSERS["bigram"]):
        spec, req = _drive_auto(runner, ids, _constrained(grammars, **params), decisions)
    assert spec == plain
    assert req.spec_proposed > 0
    first_off = decisions.index(False)  # auto switched drafting off mid-request ...
    assert True in decisions[first_off:], decisions  # ... and on again


def test_unseeded_penalised_sampling_still_drafts(runner):
    # not reproducible by design (no seed): it must still verify and finish with drafts proposed
    ids = runner.tokenizer(PENALTY_PROMPT)["input_ids"]
    # ignore_eos: an early EOS drawn by chance would end the request before any decode step drafts
    sampling = SamplingParams(max_tokens=16, temperature=0.7, repetition_penalty=1.2, ignore_eos=True)
    with _proposer(runner, PROPOSERS["unigram"]):
        _, spec, reqs, _ = _drive(runner, [ids], sampling, *SPEC)
    assert len(spec["r0"]) == 16 and reqs["r0"].spec_proposed > 0, (spec["r0"], reqs["r0"].spec_proposed)
