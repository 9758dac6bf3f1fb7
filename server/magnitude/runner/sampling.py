"""Token sampling from one step's logits: greedy, temperature, top-k, top-p, seeds, logprobs, drafts.

Greedy rows are decided in one vectorised argmax. Random rows are sampled one request at a time
(a per-request loop, never per token) because each may carry its own seed: a seeded request draws
from `Generator(seed, output index)`, so its tokens do not depend on what else shares the step.
Logprobs are those of the model's raw distribution (before temperature / top-k / top-p), as
OpenAI reports them. Stop token ids and stop strings are the scheduler's and output processor's.
"""

from __future__ import annotations

import torch

from magnitude.engine.output import SampledToken
from magnitude.engine.sampling import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, index) over the 64-bit space


def seeded_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * _SEED_MIX + index) % (1 << 63))
    return g


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to one row of float32 logits; returns the new row."""
    row = logits / params.temperature
    if params.top_k > 0 and params.top_k < row.shape[-1]:
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top token always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        row = row.scatter(0, order[drop], float("-inf"))
    return row


def _logprob_info(logprobs_row: torch.Tensor, token: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    chosen = float(logprobs_row[token])
    if n_top <= 0:
        return chosen, []
    vals, ids = torch.topk(logprobs_row, n_top)
    return chosen, [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist())]


class Sampler:
    """Chooses next tokens for the rows of a logits matrix, one row per sampling position."""

    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self._rng = torch.Generator(device=device)
        if seed is not None:
            self._rng.manual_seed(seed)
        else:
            self._rng.seed()

    def choose(self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
        """One token per row. `steps[i]` is the request's output index (seeded draws use it)."""
        logits = logits.float()
        tokens = torch.argmax(logits, dim=-1).tolist()
        for i, p in enumerate(params):
            if p.greedy:
                continue
            probs = torch.softmax(filter_logits(logits[i], p), dim=-1)
            gen = seeded_generator(p.seed, steps[i], logits.device) if p.seed is not None else self._rng
            tokens[i] = int(torch.multinomial(probs, 1, generator=gen))
        return tokens

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int]
    ) -> list[SampledToken]:
        tokens = self.choose(logits, params, steps)
        return self.attach_logprobs(logits, params, tokens)

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
