"""Speculative decoding by prompt lookup: single-stream decode speed with speculation off, on, auto.

    .venv/bin/python bench/spec_decode_bench.py [--max-tokens 64] [--threads 2] [--k 4]

Two traces, each request served alone (single stream) by the real scheduler driving the real
ModelRunner (SmolLM2-135M, float32, greedy): a copy-heavy trace (rewrite or answer from a given
passage: the output repeats spans of the prompt) and a chat trace (short questions in the chat
template). Modes: off (no draft), ngram (draftModel mode on), auto (engine/speculation.py deciding
from the measured step times, fed as AsyncEngine feeds it). Prints per trace and mode: decode
tokens/s (output tokens after the first / time from the first token to the last), ITL p50/p99
per token (tokens that land together count as gaps of 0) and the draft acceptance rate. Greedy
outputs are checked equal across modes. Timings depend on the host: not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server")]

from magnitude.engine.request import Request  # noqa: E402
from magnitude.engine.sampling import SamplingParams  # noqa: E402
from magnitude.engine.scheduler import Scheduler  # noqa: E402
from magnitude.engine.speculation import SpeculationPolicy  # noqa: E402
from magnitude.policy.load import resolve_config  # noqa: E402
from magnitude.runner import ModelRunner  # noqa: E402
from magnitude.runner.spec_decode import NgramProposer  # noqa: E402

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp, and wrote the weather in his "
    "logbook: wind from the west, light rain, three ships sighted before nightfall.",
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
    "            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n",
    "Invoice 4471. Customer: Margaret Ellison, 12 Harbour Road, Portsmouth. Items: two oak chairs at 140 pounds "
    "each, one walnut table at 620 pounds, delivery 45 pounds. Total due: 945 pounds by the 30th of June.",
]
COPY = [
    f"Copy the text exactly.\n\nText: {PASSAGES[0]}\n\nCopy:",
    f"Rewrite this function with the same names, unchanged.\n\n{PASSAGES[1]}\n# Unchanged copy:\n",
    f"Document: {PASSAGES[2]}\n\nQuote the document's sentence about the items, word for word:",
    f"Text: {PASSAGES[0]} {PASSAGES[2]}\n\nRepeat the text above exactly:",
]
CHAT = [
    "What is the capital of Australia, and why was it chosen?",
    "Give me three tips for a good night's sleep.",
    "Explain what a hash table is in two sentences.",
    "Write a short poem about autumn leaves.",
]


def serve_one(runner: ModelRunner, ids: list[int], max_tokens: int, mode: str, k: int, proposer: NgramProposer,
              policy: SpeculationPolicy | None) -> dict:
    sets = [f"kvCache.numBlocks={runner.num_blocks}", "kvCache.enablePrefixCaching=false"]
    if mode != "off":
        sets += ["draftModel.method=ngram", f"draftModel.numSpeculativeTokens={k}",
                 f"draftModel.mode={'on' if mode == 'ngram' else 'auto'}"]
    sched = Scheduler(resolve_config(None, sets))
    if policy is not None:
        sched.set_speculation(policy.enabled)  # the policy outlives requests, as in AsyncEngine
    runner.draft_proposer = proposer if mode != "off" else None
    req = Request("r", list(ids), len(ids), SamplingParams(max_tokens=max_tokens, temperature=0.0), 0.0,
                  eos_token_ids=runner.eos_token_ids)
    sched.add_request(req, time.perf_counter())
    out: list[int] = []
    while sched.has_work():
        t0 = time.perf_counter()
        plan = sched.schedule(t0)
        res = runner.execute(plan)
        now = time.perf_counter()
        for u in sched.update_from_output(plan, res, now):
            out.extend(u.new_token_ids)
        if policy is not None:
            got = res.sampled.get("r", [])
            on = policy.observe(now - t0, 1 if got and plan.num_decode else 0, len(got),
                                prefill=any(len(s.token_ids) > 1 for s in plan.seqs), drafted=bool(res.num_drafts))
            sched.set_speculation(on)
    runner.draft_proposer = None
    times = req.token_times
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"tokens": out, "decode_s": times[-1] - times[0], "decode_tokens": len(times) - 1, "gaps": gaps,
            "proposed": req.spec_proposed, "accepted": req.spec_accepted}


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="numSpeculativeTokens")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--traces", default="copy-heavy,chat", help="comma-separated: copy-heavy, chat")
    ap.add_argument("--min-ngram", type=int, default=2)
    ap.add_argument("--max-ngram", type=int, default=3)
    args = ap.parse_args()
    runner = ModelRunner(dtype="float32", num_blocks=256, num_threads=args.threads)
    proposer = NgramProposer(max_ngram=args.max_ngram, min_ngram=args.min_ngram)
    tok = runner.tokenizer
    traces = {
        "copy-heavy": [tok(p)["input_ids"] for p in COPY],
        "chat": [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=False))["input_ids"] for p in CHAT],
    }
    print(f"SmolLM2-135M float32, {args.threads} threads, greedy, max_tokens {args.max_tokens}, k {args.k}, "
          f"n-gram {args.min_ngram}..{args.max_ngram}, single stream, {args.repeats} repeat(s)")
    print(f"{'trace':<11} {'mode':<6} {'decode tok/s':>12} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'acceptance':>10} "
          f"{'speed-up':>8}")
    for name, prompts in traces.items():
        if name not in args.traces.split(","):
            continue
        base_rate = None
        reference: list[list[int]] | None = None
        for mode in ("off", "ngram", "auto"):
            secs = toks = prop = acc = 0
            gaps: list[float] = []
            outs = []
            policy = SpeculationPolicy("auto") if mode == "auto" else None
            for _ in range(args.repeats):
                for ids in prompts:
                    r = serve_one(runner, ids, args.max_tokens, mode, args.k, proposer, policy)
                    secs += r["decode_s"]
                    toks += r["decode_tokens"]
                    prop += r["proposed"]
                    acc += r["accepted"]
                    gaps += r["gaps"]
                    outs.append(r["tokens"])
            if reference is None:
                reference = outs
            elif outs != reference:
                print(f"  !! {name}/{mode}: greedy output differs from off")
            rate = toks / secs if secs else 0.0
            base_rate = base_rate or rate
            accept = f"{acc / prop:.2f}" if prop else "-"
            print(f"{name:<11} {mode:<6} {rate:>12.1f} {pct(gaps, 0.5) * 1e3:>10.1f} {pct(gaps, 0.99) * 1e3:>10.1f} "
                  f"{accept:>10} {rate / base_rate:>7.2f}x")


if __name__ == "__main__":
    main()
