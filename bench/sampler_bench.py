"""Sampling cost per step: the batched sampler against row-by-row sampling, in one run.

    .venv/bin/python bench/sampler_bench.py [--rows 32] [--threads 2] [--repeats 10]

The peer is the straightforward per-request loop (what the runner did before): temperature, top-k
via `topk`, top-p via a full sort of the vocabulary, then `torch.multinomial`, one row at a time.
Logits are random with the model's vocabulary size (49,152); prints milliseconds per step for
typical parameter mixes and the ratio. Then greedy rows (1, 8 and 24 by default, `--greedy-rows`):
the sampler's `choose` against torch's own reductions over the same rows (the NaN/inf check
`isfinite(amax)` and `argmax`, what `choose` ran before it read float32 CPU rows through numpy).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server")]

import torch  # noqa: E402

from magnitude.engine.sampling import SamplingParams  # noqa: E402
from magnitude.runner.sampling import Sampler  # noqa: E402

VOCAB = 49152


def row_by_row(logits: torch.Tensor, params: list[SamplingParams], gen: torch.Generator) -> list[int]:
    tokens = []
    for row, p in zip(logits, params):
        row = row / p.temperature
        if 0 < p.top_k < row.shape[-1]:
            row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            row = row.scatter(0, order[(torch.cumsum(probs, -1) - probs) >= p.top_p], float("-inf"))
        tokens.append(int(torch.multinomial(torch.softmax(row, -1), 1, generator=gen)))
    return tokens


def timed(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def torch_greedy(logits: torch.Tensor) -> list[int]:
    if not bool(torch.isfinite(logits.amax(-1)).all()):
        raise ValueError("unsampleable row")
    return torch.argmax(logits, dim=-1).tolist()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--greedy-rows", default="1,8,24")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    mixes = {
        "temperature 1.0": SamplingParams(temperature=1.0),
        "temperature 0.7, top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
        "temperature 0.8, top-k 50": SamplingParams(temperature=0.8, top_k=50),
        "temperature 0.7, top-p 0.9, seeded": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
    }
    print(f"{args.rows} rows x {VOCAB} vocabulary, {args.threads} threads, mean of {args.repeats}")
    print(f"{'parameters':38} {'row by row':>12} {'batched':>10} {'ratio':>7}")
    for name, sp in mixes.items():
        params, steps = [sp] * args.rows, [0] * args.rows
        gen = torch.Generator().manual_seed(0)
        sampler = Sampler(torch.device("cpu"), seed=0)
        peer = timed(lambda: row_by_row(logits, params, gen), args.repeats)
        ours = timed(lambda: sampler.choose(logits, params, steps), args.repeats)
        print(f"{name:38} {peer * 1e3:9.1f} ms {ours * 1e3:7.1f} ms {peer / ours:6.1f}x")
    print(f"{'greedy rows':38} {'torch':>12} {'choose':>10} {'ratio':>7}")
    for rows in (int(r) for r in args.greedy_rows.split(",")):
        block = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)) * 4
        params, steps = [SamplingParams(temperature=0.0)] * rows, [0] * rows
        sampler = Sampler(torch.device("cpu"), seed=0)
        assert sampler.choose(block, params, steps) == torch_greedy(block)
        peer = timed(lambda: torch_greedy(block), args.repeats * 20)
        ours = timed(lambda: sampler.choose(block, params, steps), args.repeats * 20)
        print(f"{rows:<38} {peer * 1e6:9.0f} us {ours * 1e6:7.0f} us {peer / ours:6.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
