"""Derived scheduler defaults against a sweep of hand-set token budgets, on the real model.

    .venv/bin/python bench/derived_defaults_bench.py [--dtypes fp32,bf16,int8,w4a16,w4a16-int16,w8a16] [--budgets 32,48,64,128,256,2048]
        [--traces mixed,long] [--threads 2] [--repeats 1] [--out-dir out/bench-derived]

For each dtype, `magnitude serve` runs once with nothing set (tokenBudget and prefillChunkSize null:
derived from the table it calibrates at start-up, or finds in $MAGNITUDE_CACHE/cost-models, and the
ITL target derived from the table's efficient prefill step; the
figures it derived are read from /readyz), then once per hand-set budget N (tokenBudget =
prefillChunkSize = N, no ITL target: the setting bench/runner_bench.py hand-tunes), each given the
derived run's table (`--cost-model`, fetched from GET /debug/cost-model) so only the first start pays
for calibration. The traces and the streaming client are bench/runner_bench.py's and bench/loadgen.py's
(mixed: 24 requests at once; long: chats running when a 1,500-token prompt arrives). Prints, per
dtype and trace, output tok/s and its ratio to the best of the sweep, TTFT p50, ITL p99 and the
longest stall inside a chat stream (as the client saw text arrive, and as the engine produced the
tokens: the response's `timing.max_itl_ms`; a token whose text waits to complete a character reaches
the client with the next one, so the client's gap can span two steps), the ITL targets in force
(read from /readyz before and after each trace: derived limits follow served steps), how many of the
engine's gaps between decoding steps ran over the target in force when they started, of all it
judged (`over`: magnitude_scheduler_itl_gaps_total over the trace, summed over runs), and the load average before
and after (a shared host makes every figure noisy: compare within one run). With `--repeats N` every setting runs N times, the
settings taking turns (derived, then each budget, then again), and each figure is the median of its
N runs (the stalls: the worst of them), so a slow minute of the host lands on one run of each
setting rather than on all runs of one; "of best" is the median over turns of the setting's tok/s
over that turn's best (on a host with 15% CPU steal one setting's tok/s fell from 153 to 112 over
three turns, which the ratio within a turn cancels).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "bench")]

import loadgen  # noqa: E402
import runner_bench as rb  # noqa: E402

from magnitude.sim.trace import write_trace  # noqa: E402

DTYPES = {"fp32": ["--dtype", "float32"], "bf16": ["--dtype", "bfloat16"],
          "int8": ["--dtype", "float32", "--quantization", "w8a8"],
          # weight-only low-bit linears: this GGUF's default is w4a16-bf16prefill on CPUs with
          # AVX512-BF16, w4a16-int16 on AVX2 CPUs without AVX-512, w4a16 on the others
          # (runner/defaults.py)
          "w4a16": ["--dtype", "float32", "--quantization", "w4a16"],
          "w4a16-bf16prefill": ["--dtype", "float32", "--quantization", "w4a16-bf16prefill"],
          "w4a16-int16": ["--dtype", "float32", "--quantization", "w4a16-int16"],
          "w8a16": ["--dtype", "float32", "--quantization", "w8a16"]}
ADMIN = "bench-admin"


def serve(flags: list[str], sets: list[str], env: dict[str, str], log: Path) -> tuple[subprocess.Popen, str]:
    port = rb.free_port()
    cmd = [rb.PY, "-m", "magnitude.cli.main", "serve", "--port", str(port), "--log-level", "info", *flags]
    for s in ["scheduler.maxSequences=32", "kvCache.numBlocks=1024", "admission.maxQueueWaitSeconds=600", *sets]:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def run_setting(name: str, flags: list[str], sets: list[str], traces: dict[str, Path], env: dict[str, str],
                out_dir: Path, cost_file: Path | None) -> dict:
    proc, url = serve(flags + (["--cost-model", str(cost_file)] if cost_file else []), sets, env,
                      out_dir / f"{name}.log")
    result: dict = {}
    try:
        t0 = time.monotonic()
        rb.wait_ready(url, proc)
        result["ready_s"] = round(time.monotonic() - t0, 1)
        result["scheduler"] = httpx.get(url + "/readyz").json().get("scheduler")
        if cost_file is None:
            doc = httpx.get(url + "/debug/cost-model", headers={"Authorization": f"Bearer {ADMIN}"}).json()
            # A table cached by an earlier start on this host is reused (meta.cached): its measuring time.
            result["calibration_s"] = doc["meta"].get("calibration_seconds")
            result["table_cached"] = doc["meta"].get("cached")
            (out_dir / f"{name}-cost.json").write_text(json.dumps(doc, indent=1))
        for trace, path in traces.items():
            report = out_dir / f"{name}-{trace}.json"
            before, gaps_before = httpx.get(url + "/readyz").json().get("scheduler") or {}, itl_gaps(url)
            loadgen.main([str(path), "--url", url, "--out", str(report), "--timeout", "900"])
            result[trace] = rb.summarize(json.loads(report.read_text()), trace)
            # The derived limits follow served steps (docs/scheduler.md), so the target a trace's steps
            # were bounded by is the one in force before it and, if they moved during it, the one after
            # (and any between); the engine judged each decoding gap against the target in force.
            after, gaps_after = httpx.get(url + "/readyz").json().get("scheduler") or {}, itl_gaps(url)
            result[trace]["itl_targets_ms"] = [before.get("itlTargetMs"), after.get("itlTargetMs")]
            result[trace]["itl_gaps"] = {k: gaps_after[k] - gaps_before[k] for k in gaps_after}
        print(f"  {name}: {json.dumps(result)}", flush=True)
    finally:
        rb.stop_server(proc)
    return result


def itl_gaps(url: str) -> dict[str, float]:
    """magnitude_scheduler_itl_gaps_total by result (within, over the ITL target in force)."""
    counts = {"within": 0.0, "over": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if family.name == "magnitude_scheduler_itl_gaps":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["result"]] = sample.value
    return counts


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="fp32")
    p.add_argument("--budgets", default="32,48,64,128,256,2048")
    p.add_argument("--traces", default="mixed,long")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="runs of each setting, in turns; figures are medians")
    p.add_argument("--out-dir", default=str(ROOT / "out" / "bench-derived"))
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    all_traces = {"mixed": rb.mixed_trace(), "long": rb.long_trace()}
    traces = {}
    for name in args.traces.split(","):
        traces[name] = out_dir / f"trace-{name}.jsonl"
        write_trace(all_traces[name], str(traces[name]))
    budgets = [int(b) for b in args.budgets.split(",") if b]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), GOMP_SPINCOUNT="1000", MAGNITUDE_ADMIN_TOKEN=ADMIN,
               PYTHONPATH=f"{ROOT / 'server'}:{ROOT / 'operator'}")
    results: dict = {"before": load()}
    print(results["before"], flush=True)
    for dtype in args.dtypes.split(","):
        flags = DTYPES[dtype]
        print(f"== {dtype}", flush=True)
        rows: dict[str, list[dict]] = {"derived": []}
        rows.update({str(b): [] for b in budgets})
        first_tag = "-1" if args.repeats > 1 else ""
        cost_file = out_dir / f"{dtype}-derived{first_tag}-cost.json"  # written by the first derived run
        for rep in range(args.repeats):
            tag = f"-{rep + 1}" if args.repeats > 1 else ""
            # The first start calibrates (or reads the host's cached table); the others are given it.
            rows["derived"].append(run_setting(f"{dtype}-derived{tag}", flags, [], traces, env, out_dir,
                                               cost_file if rep else None))
            for b in budgets:
                rows[str(b)].append(run_setting(f"{dtype}-{b}{tag}", flags, [f"scheduler.tokenBudget={b}",
                                                f"scheduler.prefillChunkSize={b}"], traces, env, out_dir, cost_file))
        results[dtype] = rows
    results["after"] = load()
    (out_dir / "summary.json").write_text(json.dumps(results, indent=1))
    print_table(results, args.dtypes.split(","), list(traces))
    return 0


def median_run(runs: list[dict], trace: str) -> dict:
    """One trace's figures over repeated runs: medians, and the worst stalls."""
    figures = [r[trace] for r in runs]
    out = {k: statistics.median(f[k] for f in figures) for k in ("output_tok_s", "ttft_p50", "itl_p99")}
    for k in ("longest_stall", "chat_longest_stall", "chat_engine_stall"):
        values = [f[k] for f in figures if f.get(k) is not None]
        out[k] = max(values) if values else None
    out["runs_tok_s"] = [round(f["output_tok_s"], 1) for f in figures]
    targets = [t for f in figures for t in f.get("itl_targets_ms") or [] if t is not None]
    out["targets"] = f"{min(targets):.0f}-{max(targets):.0f}" if targets else "-"
    gaps = [f["itl_gaps"] for f in figures if f.get("itl_gaps")]
    judged = sum(g["within"] + g["over"] for g in gaps)
    out["over"] = f"{sum(g['over'] for g in gaps):.0f}/{judged:.0f}" if judged else "-"
    return out


def of_best(rows: dict[str, list[dict]], trace: str) -> dict[str, float]:
    """Each setting's tok/s over the best setting's in the same turn, the median over turns: a host
    whose speed drifts (CPU steal) moves a whole turn, which the ratio cancels."""
    turns = range(min(len(runs) for runs in rows.values()))
    best = [max(runs[t][trace]["output_tok_s"] or 0.0 for runs in rows.values()) for t in turns]
    return {name: statistics.median(runs[t][trace]["output_tok_s"] / best[t] for t in turns)
            for name, runs in rows.items()}


def print_table(results: dict, dtypes: list[str], traces: list[str]) -> None:
    print(f"\n{results['before']} -> {results['after']}")
    for dtype in dtypes:
        rows = results[dtype]
        first = rows["derived"][0]
        print(f"\n{dtype}: derived {first.get('scheduler')} (calibration {first.get('calibration_s')} s)")
        for trace in traces:
            med = {name: median_run(runs, trace) for name, runs in rows.items()}
            ratio = of_best(rows, trace)
            print(f"  {trace:5} {'setting':>8} {'tok/s':>7} {'of best':>7} {'TTFT p50':>9} {'ITL p99':>8} "
                  f"{'stall':>7} {'chat stall':>10} {'engine':>7} {'target ms':>9} {'over':>9}  runs' tok/s")
            for name, m in med.items():
                print(f"  {'':5} {name:>8} {m['output_tok_s']:7.1f} {ratio[name]:7.2f} "
                      f"{m['ttft_p50']:9.2f} {m['itl_p99']:8.3f} {m['longest_stall']:7.3f} "
                      f"{m['chat_longest_stall'] or float('nan'):10.3f} {m['chat_engine_stall'] or float('nan'):7.3f} "
                      f"{m['targets']:>9} {m['over']:>9}  {m['runs_tok_s']}")


if __name__ == "__main__":
    sys.exit(main())
