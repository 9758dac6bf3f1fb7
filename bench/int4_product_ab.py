"""Magnitude's int4 product (`magnitude_int4_matmul`, runner/lowbit_kernels.c) from two or more
builds in one process: the working tree's against a git revision's, on SmolLM2's four projection
shapes (gate/up, down, q/o, k/v), interleaved, at several row counts; with `--head`, the grouped
int8 product (`magnitude_int8g_matmul`) on its LM head's shape (576 inputs, 49,152 channels: the
Q8_0 head w4a16 serves); with `--activations int16` (or int8), the int4 product of activations
rounded to integers (`magnitude_int4q16_matmul`: w4a16-int16's decode rows; int8: w4a8's), and with
`--head --activations int16` the head's product of int16 rows (`magnitude_int8gq16_matmul`:
w4a16-int16's head; a revision before it has none).

    .venv/bin/python bench/int4_product_ab.py --against HEAD [--rows 8,16,32,64,128] [--threads 2]
        [--head] [--activations fp32|int16|int8] [--variant TILE_KC=256] [--variant TILE_R=2,TILE_C=5 ...]

Each `--variant` adds a build of the working tree with those macros defined (`-DTILE_KC=256`), to
try the tile sizes lowbit_kernels.c lets a build override. `CC` picks the compiler as for the
engine (a wrapper adding `-mno-avx512f` gives an AVX2 CPU's build on an AVX-512 one). Prints, per
row count, each build's median time over 11 rounds (each round four products of each shape, the
builds' order reversed every other round) as a ratio to the revision's. Random weights and
activations: the products' speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))

from magnitude.runner import lowbit  # noqa: E402
SHAPES = [(576, 1536), (1536, 576), (576, 576), (576, 192)]  # (inputs, channels)
HEAD_SHAPES = [(576, 49152)]


def build(source: Path, defines: list[str], directory: Path) -> ctypes.CDLL:
    """The engine's own build (lowbit.build: $CC, its flags) of `source`, with `defines` added."""
    lowbit.SOURCE = source
    lib = ctypes.CDLL(str(lowbit.build(directory, flags=(*lowbit.FLAGS, *defines))))
    lowbit._declare(lib)
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="the git revision whose lowbit_kernels.c is 'old'")
    ap.add_argument("--rows", default="8,16,32,64,128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", action="append", default=[], help="macros for another working-tree build")
    ap.add_argument("--head", action="store_true", help="the grouped int8 LM head's product instead")
    ap.add_argument("--activations", choices=("fp32", "int16", "int8"), default="fp32",
                    help="the int4 product's activations: fp32, or rounded to int16 or int8 per group")
    args = ap.parse_args()
    if args.head and args.activations == "int8":
        ap.error("--head multiplies fp32 or int16 activations (w4a16-int16's head), not int8")
    work = Path(tempfile.mkdtemp(prefix="int4-ab-"))
    new_source = lowbit.SOURCE
    old_source = work / "old.c"
    old_source.write_bytes(subprocess.run(["git", "-C", str(ROOT), "show",
                                           f"{args.against}:server/magnitude/runner/lowbit_kernels.c"],
                                          check=True, capture_output=True).stdout)
    libs = {"old": build(old_source, [], work / "old"), "new": build(new_source, [], work / "new")}
    for i, variant in enumerate(args.variant):
        libs[variant] = build(new_source, [f"-D{d}" for d in variant.split(",")], work / f"v{i}")
    lowbit.SOURCE = new_source
    print(f"isa {libs['new'].magnitude_lowbit_isa().decode()}, {args.threads} threads, old = {args.against}, "
          f"{'head, ' if args.head else ''}{args.activations} activations")
    rng = np.random.default_rng(0)
    shapes = HEAD_SHAPES if args.head else SHAPES
    product = {"fp32": "magnitude_int4_matmul", "int16": "magnitude_int4q16_matmul",
               "int8": "magnitude_int4q8_matmul"}[args.activations]  # the int4 product timed
    head_product = {"fp32": "magnitude_int8g_matmul", "int16": "magnitude_int8gq16_matmul"}.get(args.activations)
    if args.head:  # int8 codes, one scale per group of 32 inputs
        weights = {(k, n): (rng.integers(-127, 128, (n, k), dtype=np.int8), rng.random((n, k // 32), dtype=np.float32),
                            None) for k, n in shapes}
    else:
        weights = {(k, n): (rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
                            rng.random((n, k // 32), dtype=np.float32), rng.random((n, k // 32), dtype=np.float32))
                   for k, n in shapes}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: rng.standard_normal((m, k), dtype=np.float32) for k in {k for k, _ in shapes}}
        ys = {n: np.empty((m, n), np.float32) for n in {n for _, n in shapes}}
        times: dict[str, list[float]] = {name: [] for name in libs}
        for rnd in range(11):
            for name in (list(libs) if rnd % 2 else list(libs)[::-1]):
                t = time.perf_counter()
                for _ in range(4):
                    for k, n in shapes:
                        codes, scales, mins = weights[k, n]
                        if args.head:
                            getattr(libs[name], head_product)(xs[k].ctypes.data, m, k, n, codes.ctypes.data,
                                                              scales.ctypes.data, ys[n].ctypes.data, args.threads)
                        else:
                            getattr(libs[name], product)(xs[k].ctypes.data, m, k, n, codes.ctypes.data,
                                                         scales.ctypes.data, mins.ctypes.data,
                                                         ys[n].ctypes.data, args.threads)
                times[name].append(time.perf_counter() - t)
        base = statistics.median(times["old"])
        flops = 4 * sum(2 * m * k * n for k, n in shapes)
        print(f"{m:4d} rows: old {base * 1e3:7.2f} ms ({flops / base / 1e9:4.0f} GFLOP/s)  "
              + "  ".join(f"{name} {statistics.median(t) / base:.2f}" for name, t in times.items() if name != "old"),
              flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
