"""Where one step's time goes in the real runner: attention, projections, MLP, LM head, sampling,
step preparation and the rest (Python/framework overhead, norms, RoPE, embeddings).

    .venv/bin/python bench/step_profile.py [--threads 2] [--decodes 8] [--prefill 64] [--context 256] [--steps 10]
        [--prefill-start 0]

`--prefill-start S` puts the chunk at positions S..S+prefill (a chunk deep in a long prompt, which
attends to S earlier tokens): the long-prompt trace's worst step is about `--decodes 12 --context 100
--prefill 96 --prefill-start 1400`.

Wall-clock timers on module forward hooks (CPU ops are synchronous, so hooks bracket real work;
on CUDA the script synchronizes in each hook, which slows it but keeps the split honest).
Prints seconds per step and percentages for a mixed step of `--decodes` decodes plus one prefill
chunk of `--prefill` tokens, after warm-up.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server")]

from magnitude.runner import ModelRunner  # noqa: E402  (first: sets GOMP_SPINCOUNT before torch loads)
from magnitude.runner import attention as paged  # noqa: E402
from magnitude.cli.profile import _plan, blocks_needed  # noqa: E402
from magnitude.engine.output import ScheduledSeq  # noqa: E402

import torch  # noqa: E402


class Timers:
    def __init__(self, cuda: bool) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.cuda = cuda
        self._start: dict[int, float] = {}

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def hook(self, module: torch.nn.Module, label: str) -> None:
        key = id(module)

        def pre(*_a, **_k):
            self._start[key] = self.now()

        def post(*_a, **_k):
            self.total[label] += self.now() - self._start.pop(key)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--decodes", type=int, default=8)
    p.add_argument("--prefill", type=int, default=64)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prefill-start", type=int, default=0, help="position of the chunk's first token")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", default=None, help="none (default) or int8")
    args = p.parse_args()
    runner = ModelRunner(device=args.device, dtype=args.dtype, num_threads=args.threads, quantization=args.quantization,
                         num_blocks=blocks_needed([args.decodes], [max(args.prefill, 1) + args.prefill_start],
                                                    args.context, 16))
    timers = Timers(runner.device.type == "cuda")
    for layer in runner.model.model.layers:
        timers.hook(layer.self_attn, "attention incl. q/k/v/o projections")
        timers.hook(layer.mlp, "mlp")
    timers.hook(runner.model.model, "model forward (all layers)")
    timers.hook(runner.model.lm_head, "lm head")

    inner = paged.paged_attention_forward

    def timed_attention(*a, **k):
        t0 = timers.now()
        try:
            return inner(*a, **k)
        finally:
            timers.total["paged attention core (cache write, gather, SDPA)"] += timers.now() - t0

    paged.AttentionInterface.register(paged.ATTN_IMPLEMENTATION, timed_attention)
    plan = _plan(args.decodes, args.prefill, args.context, runner.block_size, 0)
    if args.prefill and args.prefill_start:
        # The same chunk, deep in its prompt: its block table covers the earlier positions too.
        chunk = plan.seqs[-1]
        base = chunk.block_table[0]
        end = args.prefill_start + args.prefill
        plan.seqs[-1] = ScheduledSeq(chunk.request_id, chunk.token_ids, args.prefill_start,
                                     list(range(base, base + -(-end // runner.block_size))), True, chunk.sampling)
    for _ in range(2):
        runner.execute(plan)
    timers.total.clear()
    prepare = sample = total = 0.0
    for _ in range(args.steps):
        runner.execute(plan)
        st = runner.last_step
        prepare, sample, total = prepare + st.prepare_s, sample + st.sample_s, total + st.total_s
    n = args.steps
    t = {k: v / n for k, v in timers.total.items()}
    attn_all = t["attention incl. q/k/v/o projections"]
    core = t["paged attention core (cache write, gather, SDPA)"]
    rows = [
        ("paged attention core (cache write, gather, SDPA)", core),
        ("q/k/v/o projections + RoPE", attn_all - core),
        ("mlp", t["mlp"]),
        ("norms, residuals, embeddings, layer glue", t["model forward (all layers)"] - attn_all - t["mlp"]),
        ("lm head (sampled rows only)", t["lm head"]),
        ("sampling", sample / n),
        ("step preparation (index tensors)", prepare / n),
    ]
    accounted = sum(v for _, v in rows)
    rows.append(("other (python, dispatch, output)", total / n - accounted))
    print(f"step: {args.decodes} decodes (context {args.context}) + {args.prefill}-token prefill chunk at {args.prefill_start}; "
          f"device {runner.device}, dtype {runner.dtype}, quantization {runner.quantization}, threads {torch.get_num_threads()}")
    print(f"mean step time {total / n * 1000:.1f} ms over {n} steps")
    for name, v in rows:
        print(f"  {name:50} {v * 1000:8.1f} ms  {100 * v / (total / n):5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
