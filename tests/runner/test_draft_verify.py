"""Sampling verification of a draft model's drafts (q a distribution, not a point mass).

Drafts drawn from q, verified by `verify_drafts_q` (accept with min(1, p/q), else draw from
max(0, p - q) normalised): many seeded draws, chi-square of the first emitted token against p, and
of the tokens emitted at a rejection against the residual. A wrong residual (p itself) must fail
the same bound, so the test can tell. `Sampler.verify` with q is reproducible for seeded requests.
"""

from __future__ import annotations

import pytest

from magnitude.engine.sampling import SamplingParams

torch = pytest.importorskip("torch")

from magnitude.runner.sampling import Sampler, draw, verify_drafts_q  # noqa: E402

N = 40_000
CHI2_999 = {5: 20.52}  # p = 0.001 at 5 degrees of freedom

P = torch.tensor([0.05, 0.30, 0.25, 0.20, 0.15, 0.05], dtype=torch.float64)
Q = torch.tensor([0.30, 0.10, 0.25, 0.05, 0.10, 0.20], dtype=torch.float64)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * float(counts.sum())
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _wrong_residual(probs, q, drafts, u_accept, u_draw) -> list[int]:
    d = drafts[0]
    if float(u_accept[0]) * float(q[0, d]) < float(probs[0, d]):
        return [d, draw(probs[1:2], u_draw[1:2])[0]]
    return [draw(probs[:1], u_draw[:1])[0]]


def _run(verify) -> tuple[torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(11)
    probs = P[None].repeat(2, 1).float()
    q = Q[None].float()
    first, rejected = torch.zeros(len(P)), torch.zeros(len(P))
    accepted = 0
    for _ in range(N):
        d = draw(q, torch.rand(1, generator=g))[0]
        u = torch.rand(2, 2, generator=g)
        out = verify(probs, q, [d], u[:, 1], u[:, 0])
        first[out[0]] += 1
        if len(out) == 2:
            accepted += 1
        else:
            rejected[out[0]] += 1
    return first, rejected, accepted


def test_draft_q_verification_emits_the_target_distribution():
    first, rejected, accepted = _run(verify_drafts_q)
    assert _chi2(first, P) < CHI2_999[5]
    residual = (P - Q).clamp(min=0)
    assert _chi2(rejected, residual / residual.sum()) < CHI2_999[5]
    assert rejected[(P <= Q).nonzero()[:, 0]].sum() == 0  # never a token the draft over-proposes
    # Acceptance rate is sum(min(p, q)) = 0.65.
    assert abs(accepted / N - float(torch.minimum(P, Q).sum())) < 0.015


def test_a_wrong_residual_fails_the_same_bound():
    first, _, _ = _run(_wrong_residual)
    assert _chi2(first, P) > CHI2_999[5]


def test_equal_distributions_accept_every_draft():
    probs = P[None].repeat(3, 1).float()
    assert verify_drafts_q(probs, probs[:2], [1, 2], torch.full((2,), 0.999), torch.zeros(3))[:2] == [1, 2]


def test_seeded_verification_with_q_is_reproducible():
    logits = torch.log(P.float())[None].repeat(3, 1)
    q = torch.softmax(torch.log(Q.float()), -1)[None].repeat(2, 1)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    runs = [Sampler(torch.device("cpu"), seed=s).verify(logits, params, 4, [0, 5], q=q) for s in (1, 2)]
    assert runs[0] == runs[1]
    assert 1 <= len(runs[0]) <= 3
