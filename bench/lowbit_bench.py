"""Low-bit matmuls on SmolLM2-135M's shapes: Magnitude's kernels (runner/lowbit.py) against torch's,
at the row counts a step multiplies (decode batches and prefill chunks).

    .venv/bin/python bench/lowbit_bench.py [--threads 2] [--rows 1,2,4,8,16,32,64,128] [--repeats 200]

Per shape and row count, microseconds per call, medians of interleaved rounds (each round runs
every variant once, so a shared host's noise falls on all of them alike):
- int4 (w4a16's decoder linears): native, torch's
  `_weight_int4pack_mm_for_cpu` with bf16 activations (the fallback), fp32 matmul (the unquantized
  model);
- int8 (w8a16's linears, w4a16's LM head): native, torch's `_weight_int8pack_mm` with bf16 and
  with fp32 activations.
The last lines are the sum over one layer's projections x 30 layers, per row count: a step's
projection time per variant (one layer's weights, so they are in cache). Prints the CPU and the
kernel build it ran on.

    .venv/bin/python bench/lowbit_bench.py --cold [--rows 1,2,4,8] [--repeats 30]

`--cold`: 30 distinct layers' int4 weights (66 MB for SmolLM2, as a real step reads them from
memory), the native products of one step (median of --repeats), against a plain read of the same
bytes (torch sums of the code tensors: the memory floor those products cannot beat).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

import torch  # noqa: E402

from magnitude.runner import lowbit  # noqa: E402
from magnitude.runner.quant_eval import isa_description  # noqa: E402

# SmolLM2-135M: q/k/v fused (576 -> 960), o (576 -> 576), gate/up fused (576 -> 3072), down (1536 -> 576).
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD_SHAPE = (49152, 576)
LAYERS = 30


def _median_us(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) * 1e6 for name, ts in times.items()}


def int4_variants(k: lowbit.LowbitKernels, n: int, kk: int, m: int) -> dict[str, Callable[[], object]]:
    g = kk // 32
    codes = torch.randint(0, 16, (n, kk), dtype=torch.int32)
    c = codes.reshape(n, g, 2, 16)
    packed = (c[:, :, 0] | (c[:, :, 1] << 4)).to(torch.uint8).reshape(n, kk // 2).contiguous()
    scales, mins = torch.rand(n, g) * 0.01, -torch.rand(n, g) * 0.08
    torch_packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    sz = torch.stack([scales.t(), (mins + 8 * scales).t()], dim=-1).to(torch.bfloat16).contiguous()
    x = torch.randn(m, kk)
    xb = x.to(torch.bfloat16)
    w = (codes.reshape(n, g, 32).float() * scales[..., None] + mins[..., None]).reshape(n, kk)
    return {
        "native": lambda: k.int4_matmul(x, packed, scales, mins),
        "torch-bf16": lambda: torch._weight_int4pack_mm_for_cpu(xb, torch_packed, 32, sz).float(),
        "fp32": lambda: x @ w.t(),
    }


def int8_variants(k: lowbit.LowbitKernels, n: int, kk: int, m: int) -> dict[str, Callable[[], object]]:
    codes = torch.randint(-127, 128, (n, kk), dtype=torch.int8)
    scales = torch.rand(n) * 0.01
    x = torch.randn(m, kk)
    xb, sb = x.to(torch.bfloat16), scales.to(torch.bfloat16)
    return {
        "native": lambda: k.int8_matmul(x, codes, scales),
        "torch-bf16": lambda: torch._weight_int8pack_mm(xb, codes, sb).float(),
        "torch-fp32": lambda: torch._weight_int8pack_mm(x, codes, scales),
    }


def cold_step(k: lowbit.LowbitKernels, rows: list[int], repeats: int) -> None:
    """One step's int4 products over LAYERS distinct layers' weights, against reading them."""
    layers = []
    for _ in range(LAYERS):
        layer = []
        for n, kk in LAYER_SHAPES.values():
            codes = torch.randint(0, 256, (n, kk // 2), dtype=torch.uint8)
            layer.append((codes, torch.rand(n, kk // 32) * 0.01, -torch.rand(n, kk // 32) * 0.08, kk))
        layers.append(layer)
    mbytes = sum(c.numel() + 8 * s.numel() for layer in layers for c, s, _m, _k in layer) / 2**20
    read = lambda: [c.view(torch.int64).sum() for layer in layers for c, _s, _m, _k in layer]  # noqa: E731
    for m in rows:
        xs = {kk: torch.randn(m, kk) for kk in {kk for _n, kk in LAYER_SHAPES.values()}}
        step = lambda: [k.int4_matmul(xs[kk], c, s, mn) for layer in layers for c, s, mn, kk in layer]  # noqa: E731
        us = _median_us({"native": step, "read": read}, repeats)
        print(f"cold int4 step M={m:<3d} ({mbytes:.0f} MB)  native {us['native'] / 1000:6.2f} ms  "
              f"plain read {us['read'] / 1000:6.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--skip-head", action="store_true")
    ap.add_argument("--cold", action="store_true", help="one step over 30 distinct layers' weights (see above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k = lowbit.kernels()
    if k is None:
        sys.exit(f"the native kernels are not available: {lowbit.describe()}")
    print(f"CPU: {isa_description()}; kernels: {k.name} ({k.path}); threads {args.threads}")
    rows = [int(r) for r in args.rows.split(",")]
    if args.cold:
        cold_step(k, rows, args.repeats)
        return
    for m in rows:
        layer: dict[str, float] = {}
        for name, (n, kk) in LAYER_SHAPES.items():
            us = _median_us(int4_variants(k, n, kk, m), max(5, args.repeats // max(1, m // 8)))
            print(f"int4 {name:8s} M={m:<4d} " + "  ".join(f"{v} {t:8.1f}" for v, t in us.items()))
            for v, t in us.items():
                layer[v] = layer.get(v, 0.0) + t
        print(f"int4 step (x{LAYERS}) M={m:<4d} " + "  ".join(f"{v} {t * LAYERS / 1000:6.2f} ms" for v, t in layer.items()))
        if not args.skip_head and m <= 32:
            us = _median_us(int8_variants(k, *HEAD_SHAPE, m), max(5, args.repeats // 20))
            print(f"int8 head     M={m:<4d} " + "  ".join(f"{v} {t / 1000:6.2f} ms" for v, t in us.items()))


if __name__ == "__main__":
    main()
