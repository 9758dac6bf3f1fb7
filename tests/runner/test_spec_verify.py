"""Sampling verification of point-mass drafts: the emitted tokens follow the target distribution.

Many seeded draws through `verify_drafts`/`Sampler.verify`, chi-square against the exact target
(and, given a rejection, against the residual: the target without the draft, renormalised). A
deliberately wrong residual (the target itself, the draft not removed) must fail the same bound,
so the test can tell.
"""

from __future__ import annotations

import pytest

from magnitude.engine.sampling import SamplingParams

torch = pytest.importorskip("torch")

from magnitude.runner.sampling import Sampler, accept_drafts, draw, verify_drafts  # noqa: E402

N = 40_000
# Chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails 1 in 1000.
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = float(counts.sum())
    expected = probs * n
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


P = torch.tensor([0.05, 0.30, 0.25, 0.20, 0.15, 0.05], dtype=torch.float64)
DRAFT = 1


def _first_tokens(verify) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Counts of the first emitted token over N draws, counts of rejection outputs, #accepted."""
    g = torch.Generator().manual_seed(7)
    probs = P[None].repeat(2, 1).float()
    first = torch.zeros(len(P))
    rejected = torch.zeros(len(P))
    accepted = 0
    for _ in range(N):
        out = verify(probs, [DRAFT], torch.rand(2, generator=g))
        first[out[0]] += 1
        if len(out) == 2:
            accepted += 1
        else:
            rejected[out[0]] += 1
    return first, rejected, accepted


def _wrong_residual(probs: torch.Tensor, drafts: list[int], uniforms: torch.Tensor) -> list[int]:
    """Accepts with probability p(d) but on rejection draws from p itself (d not removed)."""
    if float(uniforms[0]) < float(probs[0, drafts[0]]):
        return [drafts[0], draw(probs[1:2], uniforms[1:2])[0]]
    u = torch.rand(1)
    return [draw(probs[:1], u)[0]]


def test_emitted_tokens_follow_the_target_and_rejections_the_residual():
    first, rejected, accepted = _first_tokens(verify_drafts)
    assert _chi2(first, P) < CHI2_999[5]
    assert abs(accepted / N - float(P[DRAFT])) < 0.01  # accepted with probability p(d)
    assert rejected[DRAFT] == 0  # the residual never emits the draft
    residual = P.clone()
    residual[DRAFT] = 0
    residual /= residual.sum()
    assert _chi2(rejected, residual) < CHI2_999[4]


def test_a_wrong_residual_fails_the_same_bound():
    first, rejected, _ = _first_tokens(_wrong_residual)
    residual = P.clone()
    residual[DRAFT] = 0
    residual /= residual.sum()
    assert _chi2(rejected, residual) > CHI2_999[4] or rejected[DRAFT] > 0
    assert _chi2(first, P) > CHI2_999[5]


def test_sampler_verify_is_seed_reproducible_and_equals_plain_seeded_draws():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=99)
    sampler = Sampler(torch.device("cpu"), seed=1)
    plain = [sampler.choose(logits[j : j + 1], [params], [5 + j])[0] for j in range(4)]
    # Drafts equal to what the plain draws chose: all accepted, bonus token from the last row.
    assert sampler.verify(logits, params, 5, plain[:3]) == plain
    # A wrong first draft: rejected, and the emitted token is still the plain draw.
    wrong = (plain[0] + 1) % 50
    assert sampler.verify(logits, params, 5, [wrong, *plain[1:3]]) == plain[:1]


def test_greedy_rule_keeps_the_matching_prefix_plus_one():
    assert accept_drafts([3, 4, 5, 6], [3, 4, 5]) == [3, 4, 5, 6]
    assert accept_drafts([3, 9, 5, 6], [3, 4, 5]) == [3, 9]


def test_prompt_lookup_copies_what_followed_the_latest_longest_match():
    from magnitude.runner.spec_decode import propose_ngram

    #          0  1  2  3  4  5  6  7  8  9
    context = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    assert propose_ngram(context, 2) == [9, 2]  # "6 7" last seen at 5..6, followed by 9, 2
    assert propose_ngram([5, 6, 7, 8, 6, 7, 9, 5, 6, 7], 3) == [8, 6, 7]  # "5 6 7" (n = 3) beats the later "6 7"
    assert propose_ngram(context, 10) == [9, 2, 6, 7]  # cut at the end of the context
    assert propose_ngram([1, 2, 3, 4], 4) == []  # no repeated bigram: no drafts
    assert propose_ngram([1, 2, 3, 2], 4, min_ngram=1) == [3, 2]  # unigrams only when asked
