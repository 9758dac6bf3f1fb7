"""Token sampling from one step's logits: greedy, temperature, top-k, top-p, seeds, logprobs, drafts.

Greedy rows are decided in one vectorised argmax. Random rows are filtered together (temperature,
top-k, top-p as batched tensor ops, each row by its own parameters) and drawn together by inverse
CDF: one uniform per row, one `cumsum`, one `searchsorted`. A seeded request's uniform comes from
`Generator(seed, output index)`, so its tokens do not depend on what else shares the step. Top-p
looks for the nucleus among the NUCLEUS_CANDIDATES most likely tokens and sorts the whole vocabulary
only for the rows whose nucleus is wider; the nucleus is a probability threshold, so tied tokens
at its edge all stay (as top-k keeps ties with the k-th value). 32 rows of a 49k vocabulary, 2 threads
(`bench/sampler_bench.py`): top-p 0.9 took 166 ms row by row (full sort + `multinomial`), 27 ms here.
Penalties and `logit_bias` change the logits of greedy and random rows before anything else:
token counts per row come from one `index_put_` over the flattened histories, so a batch costs a
few [R, V] tensor ops whatever its mix. `min_p` is a filter beside top-k and top-p.
Logprobs are those of the model's raw distribution (before temperature / top-k / top-p), as
OpenAI reports them, except under a grammar (structured outputs, constrained tool calls): the
grammar's token mask comes first, so they are those of the masked distribution. Stop token ids and stop strings are the scheduler's and output processor's.
A row that cannot be sampled (NaN or +inf logits from the model) raises ValueError naming it,
greedy or not; the runner then fails only that row's request (`ModelRunner._sample`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from magnitude.engine.output import SampledToken
from magnitude.engine.sampling import SamplingParams
from magnitude.runner.constraints import apply_constraints, mask_rows

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, index) over the 64-bit space
NUCLEUS_CANDIDATES = 1024

# (prompt token ids, generated token ids) of one row's request: what penalties look at.
History = tuple[Sequence[int], Sequence[int]]


def seeded_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * _SEED_MIX + index) % (1 << 63))
    return g


def seeded_uniforms(seed: int, index: int, n: int, device: torch.device) -> torch.Tensor:
    """The first `n` uniforms of a seeded request's stream at output index `index`: [0] draws the
    token (as a non-speculative step does), [1] accepts a sampled draft, [2] draws that draft."""
    return torch.rand(n, generator=seeded_generator(seed, index, device), device=device)


def token_counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] float32: how often each token occurs in each sequence."""
    counts = torch.zeros(len(seqs), vocab, device=device)
    lengths = torch.tensor([len(q) for q in seqs], device=device)
    if int(lengths.sum()) == 0:
        return counts
    ids = torch.tensor([t for q in seqs for t in q], dtype=torch.long, device=device)
    rows = torch.repeat_interleave(torch.arange(len(seqs), device=device), lengths)
    counts.index_put_((rows, ids), torch.ones_like(ids, dtype=counts.dtype), accumulate=True)
    return counts


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], histories: Sequence[History] | None) -> torch.Tensor:
    """Repetition, frequency and presence penalties, then `logit_bias`, on the rows whose params
    ask for them (float32 logits [R, V]); returns `logits` itself when no row does."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    out = logits.clone()
    device, vocab = logits.device, logits.shape[-1]
    penalized = [i for i in rows if params[i].penalized]
    if penalized:
        if histories is None:
            raise ValueError(f"sampling rows {penalized}: penalties need the request's tokens")

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(params[i], name) for i in penalized], dtype=out.dtype, device=device)[:, None]

        generated = token_counts([histories[i][1] for i in penalized], vocab, device)
        seen = (generated > 0) | (token_counts([histories[i][0] for i in penalized], vocab, device) > 0)
        x = out[penalized]
        rep = column("repetition_penalty")
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - column("frequency_penalty") * generated - column("presence_penalty") * (generated > 0).to(x.dtype)
        out[penalized] = x
    biased = [(i, t, b) for i in rows for t, b in params[i].logit_bias.items()]
    if biased:
        r, t, b = zip(*biased)
        out.index_put_((torch.tensor(r, device=device), torch.tensor(t, device=device)),
                       torch.tensor(b, dtype=out.dtype, device=device), accumulate=True)
    return out


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p, applied to each row of float32 logits [R, V] by
    `params[row]`; returns new logits with the filtered tokens at -inf."""
    vocab = logits.shape[-1]
    device = logits.device
    out = logits / torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)[:, None]
    min_p = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if min_p:
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p): no softmax needed.
        floor = torch.tensor([params[i].min_p for i in min_p], dtype=out.dtype, device=device).log()[:, None]
        rows = out[min_p]
        out[min_p] = rows.masked_fill(rows < rows.max(dim=-1, keepdim=True).values + floor, float("-inf"))
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(out, max(ks), dim=-1).values
        kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device)[:, None])
        kth.masked_fill_(torch.tensor([k == 0 for k in ks], device=device)[:, None], float("-inf"))
        out = out.masked_fill(out < kth, float("-inf"))  # ties with the k-th value stay
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        rows = out[nucleus]
        probs = torch.softmax(rows, dim=-1)
        top_p = torch.tensor([params[i].top_p for i in nucleus], dtype=probs.dtype, device=device)[:, None]
        out[nucleus] = rows.masked_fill(probs < nucleus_threshold(probs, top_p), float("-inf"))
    return out


def nucleus_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` [R, V], the smallest probability in the top-p nucleus ([R, 1]): tokens
    are taken from the most likely down while the ones before them hold less than top_p (the top
    token always). Defined by values alone, so tokens tied with it all stay and the result depends
    neither on how ties are ordered nor on whether the candidates or the full sort found it: both
    sum the same descending values in the same order."""
    k = min(probs.shape[-1], NUCLEUS_CANDIDATES)
    ranked = torch.topk(probs, k, dim=-1).values
    threshold, mass = _threshold_of_ranked(ranked, top_p)
    wide = mass[:, -1] < top_p[:, 0]  # the nucleus goes past the candidates
    if k < probs.shape[-1] and bool(wide.any()):
        full = torch.sort(probs[wide], dim=-1, descending=True).values
        threshold[wide] = _threshold_of_ranked(full, top_p[wide])[0]
    return threshold


def _threshold_of_ranked(ranked: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(threshold [R, 1], cumulative mass [R, K]) over probabilities ranked in descending order."""
    mass = torch.cumsum(ranked, dim=-1)
    inside = (mass - ranked) < top_p  # a prefix
    # At least one token long: a top_p below float32's range (1e-300) rounds to 0, and 0 < 0 fails.
    return ranked.gather(1, inside.sum(dim=-1, keepdim=True).clamp(min=1) - 1), mass


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """Inverse-CDF sampling: row r takes the first token whose cumulative probability exceeds
    uniforms[r] * (row total). A zero-probability token is never chosen: its CDF step is flat.
    The CDF is summed in float64: in float32, 49k small terms round away thousands of tokens."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    total = cdf[:, -1]
    bad = ~(torch.isfinite(total) & (total > 0))
    if bool(bad.any()):
        raise ValueError(f"sampling rows {bad.nonzero()[:, 0].tolist()}: probabilities are NaN, infinite or all zero")
    return torch.searchsorted(cdf, (uniforms.double() * total)[:, None], right=True)[:, 0].tolist()


def _host_rows(logits: torch.Tensor) -> np.ndarray | None:
    """`logits` [R, V] as a numpy view where they are float32 on the CPU, else None. Greedy rows'
    reductions over the vocabulary run there: one 49k-token row's NaN/inf check and argmax took
    86 µs through torch against 24 µs for all of `choose`, 24 rows 1,182 against 286 µs
    (`bench/sampler_bench.py`, two AVX2 EPYC cores, 2026-12-06)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.numel() == 0:
        return None  # (numpy's max refuses an empty reduction where torch's gives an empty result)
    return logits.detach().numpy()


def row_argmax(logits: torch.Tensor) -> list[int]:
    """Each row's index of its largest logit, the first one where several tie (torch's and numpy's
    rule alike)."""
    host = _host_rows(logits)
    if host is not None:
        return host.argmax(-1).tolist()
    return torch.argmax(logits, dim=-1).tolist()


def check_logits(logits: torch.Tensor) -> None:
    """Raise ValueError naming the rows with a NaN or +inf logit, or no finite one: argmax would
    "choose" from them (NaN counts as the maximum) and the random draw cannot."""
    # One pass: a row's maximum is NaN if it holds a NaN (torch's and numpy's max propagate it),
    # +inf if it holds +inf, -inf if every logit is -inf; finite exactly when the row can be sampled.
    host = _host_rows(logits)
    if host is not None:
        bad_rows = np.flatnonzero(~np.isfinite(host.max(-1))).tolist()
    else:
        bad = ~torch.isfinite(logits.amax(-1))
        bad_rows = bad.nonzero()[:, 0].tolist() if bool(bad.any()) else []
    if bad_rows:
        raise ValueError(f"sampling rows {bad_rows}: logits are NaN, infinite or all -inf")


def _logprob_info(logprobs_row: torch.Tensor, token: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    chosen = float(logprobs_row[token])
    if n_top <= 0:
        return chosen, []
    vals, ids = torch.topk(logprobs_row, n_top)
    # Under a grammar fewer than n_top tokens may be possible: the impossible ones are no alternatives.
    return chosen, [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist()) if v != float("-inf")]


class Sampler:
    """Chooses next tokens for the rows of a logits matrix, one row per sampling position."""

    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self._rng = torch.Generator(device=device)
        if seed is not None:
            self._rng.manual_seed(seed)
        else:
            self._rng.seed()

    def choose(self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
               histories: Sequence[History] | None = None) -> list[int]:
        """One token per row. `steps[i]` is the request's output index (seeded draws use it);
        `histories[i]` its tokens so far (penalties need them). Rows under a grammar must already
        be masked (`sample` does it)."""
        logits = logits.float()
        check_logits(logits)
        logits = adjust_logits(logits, params, histories)
        tokens = row_argmax(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return tokens
        probs = torch.softmax(filter_logits(logits[random_rows], [params[i] for i in random_rows]), dim=-1)
        uniforms = torch.rand(len(random_rows), generator=self._rng, device=logits.device)
        for j, i in enumerate(random_rows):
            seed = params[i].seed
            if seed is not None:
                uniforms[j] = torch.rand(1, generator=seeded_generator(seed, steps[i], logits.device),
                                         device=logits.device)[0]
        for i, token in zip(random_rows, draw(probs, uniforms)):
            tokens[i] = token
        return tokens

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
        histories: Sequence[History] | None = None,
    ) -> list[SampledToken]:
        if any(p.constraint is not None for p in params):
            logits = logits.float()
            check_logits(logits)
            logits = apply_constraints(logits.clone(), params)
        tokens = self.choose(logits, params, steps, histories)
        return self.attach_logprobs(logits, params, tokens)

    def verify(self, logits: torch.Tensor, params: SamplingParams, step: int, drafts: list[int],
               q: torch.Tensor | None = None) -> list[int]:
        """Sampling verification of one request's point-mass drafts (`verify_drafts`): `logits`
        holds len(drafts) + 1 rows, row j the position before draft j. Row j's uniform is the one a
        non-speculative step at output index `step + j` would draw (seeded: Generator(seed, index)),
        so a seeded request's tokens are the same with speculation on, off or toggled by auto.
        With `q` ([len(drafts), V], the draft model's distributions the drafts were drawn from):
        `verify_drafts_q`, seeded by the same per-position streams (reproducible, though not the
        tokens of speculation off: acceptance takes a uniform of its own)."""
        logits = logits.float()
        check_logits(logits)
        probs = torch.softmax(filter_logits(logits, [params] * logits.shape[0]), dim=-1)
        if q is not None:
            rows = logits.shape[0]
            if params.seed is not None:
                u = torch.stack([seeded_uniforms(params.seed, step + j, 2, logits.device) for j in range(rows)])
            else:
                u = torch.rand(rows, 2, generator=self._rng, device=logits.device)
            return verify_drafts_q(probs, q.to(probs.dtype), drafts, u[:, 1], u[:, 0])
        if params.seed is not None:
            uniforms = torch.cat([torch.rand(1, generator=seeded_generator(params.seed, step + j, logits.device),
                                             device=logits.device) for j in range(logits.shape[0])])
        else:
            uniforms = torch.rand(logits.shape[0], generator=self._rng, device=logits.device)
        return verify_drafts(probs, drafts, uniforms)

    def verify_row(self, logits: torch.Tensor, params: SamplingParams, step: int, drafts: list[int],
                   history: History, bitmask: torch.Tensor | None = None,
                   q: torch.Tensor | None = None) -> list[SampledToken]:
        """One request's drafts verified against `logits` (len(drafts) + 1 rows, row j the position
        before draft j), each row seen as a non-speculative step would see it had drafts[:j] been
        its tokens: grammar mask row j (`bitmask`, from `constraints.advance_through_drafts`)
        first, then penalties counting the output plus drafts[:j] (if row j's token is kept, those
        drafts were all accepted) and logit_bias; then greedy matching or the rejection rule
        (`verify`). Logprobs, as in `sample`, are those of the masked, unadjusted rows. So the
        tokens equal non-speculative decoding's: token for token when greedy or seeded."""
        logits = logits.float()
        check_logits(logits)
        if bitmask is not None:
            logits = mask_rows(logits, bitmask)
        n = len(drafts) + 1
        adjusted = logits
        if params.adjusts_logits:
            prompt, output = history
            adjusted = adjust_logits(logits, [params] * n, [(prompt, [*output, *drafts[:j]]) for j in range(n)])
        if params.greedy:
            kept = accept_drafts(row_argmax(adjusted), drafts)
        else:
            kept = self.verify(adjusted, params, step, drafts, q)
        return self.attach_logprobs(logits[: len(kept)], [params] * len(kept), kept)

    @staticmethod
    def attach_logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list[SampledToken]:
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        out = [SampledToken(t) for t in tokens]
        if want:
            lp = torch.log_softmax(logits[want].float(), dim=-1)
            for row, i in enumerate(want):
                chosen, top = _logprob_info(lp[row], tokens[i], params[i].logprobs or 0)
                out[i].logprob = chosen
                out[i].top_logprobs = top
        return out


def accept_drafts(target_tokens: list[int], drafts: list[int]) -> list[int]:
    """Greedy speculative verification: keep drafts while they equal the model's own choice, then
    add the model's token at the first mismatch (or the bonus token after all drafts).
    `target_tokens[i]` is the model's choice at the position before draft i (len(drafts) + 1 rows)."""
    accepted: list[int] = []
    for i, d in enumerate(drafts):
        accepted.append(target_tokens[i])
        if d != target_tokens[i]:
            return accepted
    accepted.append(target_tokens[len(drafts)])
    return accepted


def verify_drafts(probs: torch.Tensor, drafts: list[int], uniforms: torch.Tensor) -> list[int]:
    """Rejection sampling (Leviathan et al. 2023, Chen et al. 2023) for a deterministic proposer.

    The general rule accepts draft d with probability min(1, p(d) / q(d)) and on rejection draws
    from max(0, p - q) normalised. A point-mass q (q(d) = 1) makes that: accept with probability
    p(d); on rejection draw from p with d removed, renormalised. Both come from one inverse-CDF draw
    x = F_p^-1(u): P(x = d) = p(d), and given x != d, x is distributed as p without d,
    renormalised — the residual. So each position draws x from the target row, keeps d while x
    equals it, and at the first mismatch emits x (the residual draw); after all drafts the last row
    gives the bonus token. `probs` [len(drafts) + 1, V], `uniforms` one per row."""
    return accept_drafts(draw(probs[: len(drafts) + 1], uniforms[: len(drafts) + 1]), drafts)


def verify_drafts_q(probs: torch.Tensor, q: torch.Tensor, drafts: list[int], u_accept: torch.Tensor,
                    u_draw: torch.Tensor) -> list[int]:
    """Rejection sampling (Leviathan et al. 2023, Chen et al. 2023) for drafts drawn from a draft
    model's distributions: draft j (drawn from q[j]) is accepted with probability min(1, p(d) / q(d))
    (u_accept[j] * q(d) < p(d)); at the first rejection the token is drawn from max(0, p - q)
    normalised (u_draw[j]) and the rest are dropped; after all drafts row len(drafts) of p gives
    the bonus token. So each emitted token is distributed exactly as p. `probs` [len(drafts) + 1, V]."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        pd, qd = float(probs[j, d]), float(q[j, d])
        if qd > 0.0 and float(u_accept[j]) * qd < pd:
            out.append(d)
            continue
        residual = (probs[j] - q[j]).clamp(min=0.0)
        if not float(residual.sum()) > 0.0:  # p <= q everywhere means p == q: rejection had probability 0
            residual = probs[j]
        out.append(draw(residual[None], u_draw[j : j + 1])[0])
        return out
    n = len(drafts)
    out.append(draw(probs[n : n + 1], u_draw[n : n + 1])[0])
    return out
