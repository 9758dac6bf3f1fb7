"""Prompt lookup: the n-gram draft proposer for speculative decoding (no second model).

The request's own context (prompt, then the tokens generated so far) is searched for the most
recent earlier occurrence of its last n tokens, longest n first (`max_ngram` down to `min_ngram`,
3 and 2 by default); the tokens that followed that occurrence are the drafts. Copy-heavy work
(editing, extraction, answers quoting a passage) repeats spans of the prompt, so the drafts are
often exactly what the model would write. Deterministic: the same context always gives the same drafts,
so for sampling verification the draft distribution is a point mass (runner/sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from magnitude.engine.output import ScheduledSeq


@dataclass(slots=True)
class NgramProposer:
    """Implements runner.DraftProposer by prompt lookup."""

    max_ngram: int = 3
    # A single shared token is too weak a match: at 1, chat drafts were accepted 15% of the time,
    # at 2, 32% (copy-heavy 51% -> 73%; bench/spec_decode_bench.py).
    min_ngram: int = 2
    # Only the last `window` tokens are searched: the cost per decode stays bounded on long contexts.
    window: int = 4096

    method = "ngram"

    def propose(self, seq: ScheduledSeq, k: int) -> list[int]:
        context = [*seq.prompt_token_ids, *seq.output_token_ids]
        if seq.token_ids and (not context or context[-1] != seq.token_ids[-1]):
            context.append(seq.token_ids[-1])  # a runner driven without the request's lists
        return propose_ngram(context[-self.window:], k, self.max_ngram, self.min_ngram)


def propose_ngram(context: list[int], k: int, max_ngram: int = 3, min_ngram: int = 2) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of `context`'s last n tokens."""
    n_ctx = len(context)
    if k <= 0 or n_ctx < 2:
        return []
    arr = np.asarray(context, dtype=np.int64)
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        tail = arr[n_ctx - n:]
        # Candidate starts: every earlier window of n tokens (the tail itself excluded).
        windows = np.lib.stride_tricks.sliding_window_view(arr[: n_ctx - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence: the local pattern repeats best
            return [int(t) for t in arr[start : start + k]]
    return []


__all__ = ["NgramProposer", "propose_ngram"]
