"""The batched sampler on synthetic logits (no model): each row obeys its own parameters, seeded
rows do not depend on the batch, and random rows follow the filtered distribution."""

from __future__ import annotations

import pytest

from magnitude.engine.sampling import SamplingParams

torch = pytest.importorskip("torch")

from magnitude.runner.sampling import Sampler, adjust_logits, check_logits, filter_logits, row_argmax  # noqa: E402

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def test_each_row_keeps_exactly_what_its_own_filters_allow():
    logits = _logits(4)
    logits[2, 7] = logits[2, 9] = 50.0  # a tie at the top: top_k=1 keeps both
    params = [SamplingParams(temperature=0.5, top_k=3), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=2.0)]
    out = filter_logits(logits, params)
    kept = [set(torch.isfinite(row).nonzero()[:, 0].tolist()) for row in out]
    assert kept[0] == set(torch.topk(logits[0], 3).indices.tolist())
    # top_p: the smallest prefix of the sorted distribution whose mass reaches 0.5
    probs, order = torch.sort(torch.softmax(logits[1], -1), descending=True)
    n = int((torch.cumsum(probs, -1) < 0.5).sum()) + 1
    assert kept[1] == set(order[:n].tolist())
    assert kept[2] == {7, 9}
    assert kept[3] == set(range(VOCAB))
    assert torch.allclose(out[0][list(kept[0])], logits[0][list(kept[0])] / 0.5)
    assert torch.allclose(out[3], logits[3] / 2.0)


def test_greedy_rows_take_the_argmax_and_seeded_rows_ignore_their_neighbours():
    logits = _logits(5, seed=1)
    hot = SamplingParams(temperature=1.3, top_p=0.9, seed=7)
    sampler = Sampler(torch.device("cpu"), seed=0)
    params = [SamplingParams(temperature=0.0), hot, SamplingParams(temperature=1.0), SamplingParams(temperature=0.7,
                                                                                                  top_k=5), hot]
    steps = [0, 3, 0, 0, 3]
    tokens = sampler.choose(logits, params, steps)
    assert tokens[0] == int(torch.argmax(logits[0]))
    alone = Sampler(torch.device("cpu"), seed=123).choose(logits[1:2], [hot], [3])[0]
    assert tokens[1] == alone
    # Same seed and output index on another row of logits: drawn from that row, same generator state.
    assert tokens[4] == Sampler(torch.device("cpu")).choose(logits[4:5], [hot], [3])[0]
    assert tokens[3] in set(torch.topk(logits[3], 5).indices.tolist())


def test_unseeded_rows_follow_the_filtered_distribution():
    # 4,000 draws of one row batched with others: frequencies within 3.5 sigma of softmax(logits / T).
    logits = _logits(1, seed=2)[0] / 3
    params = SamplingParams(temperature=0.8, top_k=6)
    sampler = Sampler(torch.device("cpu"), seed=5)
    batch = logits.repeat(8, 1)
    counts = torch.zeros(VOCAB)
    for _ in range(500):
        for t in sampler.choose(batch, [params] * 8, [0] * 8):
            counts[t] += 1
    expected = torch.softmax(filter_logits(logits[None], [params])[0], -1)
    n = counts.sum()
    sigma = torch.sqrt(n * expected * (1 - expected)).clamp(min=1.0)
    assert counts[expected == 0].sum() == 0
    assert bool(((counts - n * expected).abs() <= 3.5 * sigma).all()), (counts, n * expected)


def _reference_nucleus(row: torch.Tensor, top_p: float) -> set[int]:
    probs, order = torch.sort(torch.softmax(row, -1), descending=True)
    return set(order[(torch.cumsum(probs, -1) - probs) < top_p].tolist())


def test_top_p_matches_a_full_sort_whether_the_nucleus_fits_the_candidates_or_not():
    from magnitude.runner.sampling import NUCLEUS_CANDIDATES

    g = torch.Generator().manual_seed(3)
    vocab = 4 * NUCLEUS_CANDIDATES
    peaky, flat = torch.randn(vocab, generator=g) * 8, torch.randn(vocab, generator=g) * 0.01
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 2
    out = filter_logits(torch.stack([peaky, flat]), params)
    kept = [set(torch.isfinite(row).nonzero()[:, 0].tolist()) for row in out]
    assert kept[0] == _reference_nucleus(peaky, 0.9) and len(kept[0]) < NUCLEUS_CANDIDATES
    assert kept[1] == _reference_nucleus(flat, 0.9) and len(kept[1]) > NUCLEUS_CANDIDATES
    # Alone, the peaky row takes the candidate path; batched with the flat one, the full sort.
    assert set(torch.isfinite(filter_logits(peaky[None], params[:1])[0]).nonzero()[:, 0].tolist()) == kept[0]


def test_a_rows_nucleus_does_not_depend_on_its_batch_even_with_ties():
    # bf16-rounded logits (what a bf16 model produces) tie often; a flat row in the batch forces
    # the full-sort path. Each row must keep the same tokens alone and batched.
    from magnitude.runner.sampling import NUCLEUS_CANDIDATES

    g = torch.Generator().manual_seed(4)
    vocab = 4 * NUCLEUS_CANDIDATES
    rows = (torch.randn(40, vocab, generator=g) * 3).bfloat16().float()
    flat = torch.randn(1, vocab, generator=g) * 0.01
    params = [SamplingParams(temperature=1.0, top_p=0.5)]
    batched = filter_logits(torch.cat([rows, flat]), params * 41)[:40]
    for row, together in zip(rows, batched):
        alone = filter_logits(row[None], params)[0]
        assert torch.equal(torch.isfinite(alone), torch.isfinite(together))


def test_top_p_draws_follow_the_nucleus_distribution():
    logits = _logits(1, seed=6)[0] / 2
    params = SamplingParams(temperature=1.0, top_p=0.8)
    sampler = Sampler(torch.device("cpu"), seed=8)
    counts = torch.zeros(VOCAB)
    for _ in range(500):
        for t in sampler.choose(logits.repeat(8, 1), [params] * 8, [0] * 8):
            counts[t] += 1
    expected = torch.softmax(filter_logits(logits[None], [params])[0], -1)
    n = counts.sum()
    assert counts[expected == 0].sum() == 0 and int((expected > 0).sum()) > 1
    assert bool(((counts - n * expected).abs() <= 3.5 * torch.sqrt(n * expected * (1 - expected)).clamp(min=1.0)).all())


def test_broken_probabilities_fail_loudly_instead_of_picking_a_token():
    from magnitude.runner.sampling import draw

    probs = torch.softmax(_logits(3, seed=7), -1)
    probs[1, 4] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        draw(probs, torch.rand(3))
    logits = _logits(2, seed=7)
    logits[0, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN"):
        Sampler(torch.device("cpu"), seed=0).choose(logits, [SamplingParams(temperature=1.0)] * 2, [0, 0])


@pytest.mark.parametrize("temperature", [1e-40, 1e-8, 1e-6])
def test_temperatures_too_small_to_sample_with_are_greedy(temperature):
    # 1e-40 is a float32 subnormal: logits / T overflow to inf and softmax gives NaN for the row.
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    logits = _logits(3, seed=3)
    assert Sampler(torch.device("cpu"), seed=0).choose(logits, [params] * 3, [0] * 3) == torch.argmax(logits, -1).tolist()


def test_the_row_argmax_is_torchs_for_every_layout_and_dtype():
    """row_argmax reads float32 CPU rows through numpy and anything else through torch: the same
    index either way, the first of tied maxima, for strided views (a padded vocabulary's slice,
    a step's selected rows) as for whole tensors."""
    logits = _logits(6, seed=7)
    logits[2, 3] = logits[2, 40] = logits[2].max() + 1.0  # a tie: the first one wins
    logits[4] = 0.0  # all tied: index 0
    wide = torch.cat([logits, torch.full((6, 9), 1e9)], dim=1)
    for rows in (logits, wide[:, :VOCAB], logits[[5, 2, 0]], logits.t().contiguous().t()):
        assert row_argmax(rows) == torch.argmax(rows, dim=-1).tolist()
    assert row_argmax(logits)[2] == 3 and row_argmax(logits)[4] == 0
    half = logits.to(torch.bfloat16)  # not float32: torch's own argmax
    assert row_argmax(half) == torch.argmax(half, dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_that_cannot_be_sampled_are_named_on_either_path(dtype):
    logits = _logits(5, seed=3)
    logits[1, 4] = float("nan")
    logits[3] = float("-inf")
    logits[4, 0] = float("inf")
    logits[0, :10] = float("-inf")  # a masked token beside finite ones: fine
    with pytest.raises(ValueError, match=r"rows \[1, 3, 4\]"):
        check_logits(logits.to(dtype))
    check_logits(logits[[0, 2]].to(dtype))  # the good rows pass
    check_logits(logits[:0].to(dtype))  # no rows: nothing to refuse
    assert row_argmax(logits[:0].to(dtype)) == []


def test_broken_logits_are_refused_for_greedy_rows_too():
    # A NaN row would otherwise be "decided" by argmax (NaN counts as the maximum): garbage, silently.
    logits = _logits(2, seed=4)
    logits[1, 5] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        Sampler(torch.device("cpu"), seed=0).choose(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0])
    # +inf anywhere, or nothing but -inf, is refused too; -inf beside finite logits is a masked token
    logits = _logits(4, seed=4)
    logits[0, 2] = float("inf")
    logits[1] = float("-inf")
    logits[2, :7] = float("-inf")
    logits[3, -1] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[0, 1, 3\]"):
        Sampler(torch.device("cpu"), seed=0).choose(logits, [SamplingParams(temperature=0.0)] * 4, [0] * 4)


@pytest.mark.parametrize("top_p", [1e-12, 1e-300, 5e-324])
def test_a_nucleus_too_small_for_float32_is_the_top_token(top_p):
    # 1e-300 and 5e-324 round to 0.0 in float32: the nucleus must still hold the top token.
    logits = _logits(3, seed=5)
    params = [SamplingParams(temperature=1.0, top_p=top_p)] * 3
    kept = [torch.isfinite(row).nonzero()[:, 0].tolist() for row in filter_logits(logits, params)]
    assert kept == [[int(i)] for i in torch.argmax(logits, -1)]
    assert Sampler(torch.device("cpu"), seed=0).choose(logits, params, [0] * 3) == torch.argmax(logits, -1).tolist()


# -- penalties, logit_bias, min_p -------------------------------------------------------------------


def test_penalties_change_exactly_the_seen_tokens_of_their_own_row():
    logits = _logits(3, seed=4)
    prompt, generated = [1, 2], [3, 3, 4]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5),
              SamplingParams(),  # untouched though batched with penalized rows
              SamplingParams(frequency_penalty=-1.0)]
    histories = [(prompt, generated), ([5], [5, 6]), ([], [7, 7])]
    out = adjust_logits(logits, params, histories)
    expected = logits[0].clone()
    for t in (1, 2, 3, 4):  # repetition: prompt and output tokens
        expected[t] = expected[t] / 1.5 if expected[t] > 0 else expected[t] * 1.5
    expected[3] -= 0.5 + 0.25 * 2  # presence once, frequency per occurrence (outputs only)
    expected[4] -= 0.5 + 0.25
    assert torch.allclose(out[0], expected)
    assert torch.equal(out[1], logits[1])
    assert torch.allclose(out[2, 7], logits[2, 7] + 2.0)
    assert torch.equal(torch.cat([out[2, :7], out[2, 8:]]), torch.cat([logits[2, :7], logits[2, 8:]]))


def test_logit_bias_steers_greedy_and_random_rows_and_stays_in_its_row():
    logits = _logits(3, seed=6)
    sampler = Sampler(torch.device("cpu"), seed=0)
    banned_top = int(torch.argmax(logits[0]))
    params = [SamplingParams(temperature=0.0, logit_bias={banned_top: -100.0}),
              SamplingParams(temperature=1.0, logit_bias={11: 100.0}),
              SamplingParams(temperature=0.0)]
    tokens = sampler.choose(logits, params, [0, 0, 0])
    assert tokens[0] == int(torch.topk(logits[0], 2).indices[1])  # the runner-up
    assert tokens[1] == 11
    assert tokens[2] == int(torch.argmax(logits[2]))


def test_a_penalized_greedy_decode_does_not_repeat_itself():
    # Teacher-free loop on fixed logits: without a penalty greedy repeats its argmax forever.
    logits = _logits(1, seed=8)
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, repetition_penalty=10.0)
    out: list[int] = []
    for step in range(5):
        out.append(sampler.choose(logits.clone(), [params], [step], [([], out)])[0])
    assert len(set(out)) == 5
    assert out[0] == int(torch.argmax(logits[0]))


def test_penalties_without_the_history_fail_instead_of_being_skipped():
    with pytest.raises(ValueError, match="penalties need"):
        Sampler(torch.device("cpu")).choose(_logits(1), [SamplingParams(presence_penalty=1.0)], [0])


def test_min_p_keeps_the_tokens_at_least_that_fraction_of_the_top():
    logits = _logits(2, seed=9)
    params = [SamplingParams(temperature=0.7, min_p=0.2), SamplingParams(temperature=0.7)]
    out = filter_logits(logits, params)
    probs = torch.softmax(logits[0] / 0.7, -1)
    assert set(torch.isfinite(out[0]).nonzero()[:, 0].tolist()) == set((probs >= 0.2 * probs.max()).nonzero()[:, 0].tolist())
    assert torch.isfinite(out[1]).all()


def test_min_p_draws_follow_the_renormalised_distribution():
    logits = _logits(1, seed=10)[0] / 3
    params = SamplingParams(temperature=1.0, min_p=0.3)
    probs = torch.softmax(logits, -1)
    kept = probs >= 0.3 * probs.max()
    expected = torch.where(kept, probs, torch.zeros_like(probs))
    expected = expected / expected.sum()
    sampler = Sampler(torch.device("cpu"), seed=11)
    n = 4000
    tokens = [sampler.choose(logits[None].clone(), [params], [0])[0] for _ in range(n)]
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    assert set(counts.nonzero()[:, 0].tolist()) <= set(kept.nonzero()[:, 0].tolist())
    sigma = (n * expected * (1 - expected)).sqrt().double()
    assert bool(((counts - n * expected.double()).abs() <= 3.5 * sigma + 1).all())


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(frequency_penalty=-2.1), dict(repetition_penalty=0.0),
                                dict(min_p=1.1), dict(logit_bias={3: 101.0}), dict(logit_bias={-1: 1.0})])
def test_out_of_range_adjustments_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


class AllowOnly:
    """A TokenConstraint allowing a fixed token set (xgrammar's packed layout: bit t of word t//32)."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed
        self.accepted: list[int] = []

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bits = [0] * bitmask.shape[1]
        for t in self.allowed:
            bits[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32)

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id in self.allowed


def test_grammar_masked_draws_follow_the_renormalised_distribution_and_logprobs_are_masked():
    logits = _logits(1, seed=9)[0] / 2
    allowed = {1, 7, 33, 40, 49}  # across two bitmask words, and the last token of the vocabulary
    params = SamplingParams(temperature=1.0, constraint=AllowOnly(allowed), logprobs=3)
    plain = SamplingParams(temperature=1.0)
    sampler = Sampler(torch.device("cpu"), seed=10)
    counts = torch.zeros(VOCAB)
    for _ in range(500):
        # A constrained row beside an unconstrained one: the mask stays in its row.
        out = sampler.sample(logits.repeat(2, 1), [params, plain], [0, 0])
        counts[out[0].token_id] += 1
    mask = torch.full((VOCAB,), float("-inf"))
    mask[list(allowed)] = 0.0
    expected = torch.softmax(logits + mask, -1)
    n = counts.sum()
    assert counts[expected == 0].sum() == 0
    assert bool(((counts - n * expected).abs() <= 3.5 * torch.sqrt(n * expected * (1 - expected)).clamp(min=1.0)).all())
    # Logprobs report the masked distribution: alternatives are allowed tokens, probabilities renormalised.
    top = out[0].top_logprobs
    assert {t for t, _ in top} <= allowed and len(top) == 3
    assert abs(out[0].logprob - float(torch.log(expected[out[0].token_id]))) < 1e-4


def test_a_grammar_that_allows_nothing_fails_its_row():
    params = SamplingParams(temperature=0.0, constraint=AllowOnly(set()))
    with pytest.raises(ValueError, match=r"rows \[0\]"):
        Sampler(torch.device("cpu"), seed=0).sample(_logits(1, seed=1), [params], [0])
