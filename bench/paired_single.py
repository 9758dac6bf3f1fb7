"""Single-stream ms/token (or 24-at-once req/s) of two or more servers, paired: every server up at
once, the trace run on each in turn, so a shared host's slow minutes fall on all of them alike.

    .venv/bin/python bench/paired_single.py [--systems llama,magnitude-default] [--rounds 8]
        [--trace single|mixed] [--threads 2] [--llama-server PATH] [--out-dir out/bench-paired-single]

runner_bench.py starts one server at a time and measures its traces before the next starts; on a
two-core host whose speed moves by a quarter within minutes, its single-stream ratio moved from
1.23x to 1.68x between runs (bench/results/runner_llama.md, S56). Here each round sends one lone
request (runner_bench's single trace: a 32-token prompt, 129 greedy tokens) to each server in turn,
the order reversed every other round, while the others sit idle; prints each request's mean gap
between output tokens as the client saw it, each server's median, and the median over rounds of
each server's time over the first system's in the same round. Each round's prompt is new (its
request id carries the round), so no server answers from a prompt cache it filled earlier.
Servers are started as runner_bench.py starts them (same flags, threads and environment).

`--trace mixed` runs runner_bench's mixed trace instead (24 requests at once, prompts 16-400
tokens, outputs 16-64) on each server in turn: each server's requests finished a second, and the
median of the rounds' throughput ratios to the first system (higher is faster there). The ids, and
so the prompts, carry the round here too.

Each Magnitude server's scheduler limits after the last round (/readyz: derived limits follow the
steps it served) are printed and kept in summary.json with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "bench")]

import loadgen  # noqa: E402
import runner_bench as rb  # noqa: E402

from magnitude.sim.trace import write_trace  # noqa: E402


def start(system: str, args: argparse.Namespace, gguf: Path, out_dir: Path) -> tuple[subprocess.Popen, str]:
    port = rb.free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), GOMP_SPINCOUNT="1000",
               PYTHONPATH=f"{ROOT / 'server'}:{ROOT / 'operator'}", **rb.VARIANT_ENV.get(system, {}))
    log = (out_dir / f"{system}.log").open("w")
    proc = subprocess.Popen(rb.server_command(system, port, args, gguf), env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


# trace name -> (its records, the figure taken from a run, that figure's unit)
TRACES = {
    "single": (rb.single_trace, lambda s: s["itl"]["mean"] * 1000.0, "ms/token"),
    "mixed": (rb.mixed_trace, lambda s: s["finished"] / s["duration"], "req/s"),
}


def run_trace(url: str, trace_name: str, round_: int, system: str, out_dir: Path) -> float:
    """The trace alone on `url`, its ids (so its prompts) new for the round: the trace's figure."""
    records, figure, _ = TRACES[trace_name]
    recs = [r.model_copy(update={"id": f"{r.id}-{round_}"}) for r in records()]
    trace = out_dir / f"trace-{system}-{round_}.jsonl"
    write_trace(recs, str(trace))
    report = out_dir / f"{system}-{round_}.json"
    loadgen.main([str(trace), "--url", url, "--out", str(report), "--timeout", "600"])
    summary = json.loads(report.read_text())["summary"]
    if summary["finished"] != len(recs):
        raise RuntimeError(f"{system}: {summary['finished']} of {len(recs)} requests finished in round {round_}")
    return figure(summary)


def scheduler_limits(url: str) -> dict | None:
    """A Magnitude server's scheduler limits now (its /readyz), None for a server without them."""
    reply = httpx.get(url + "/readyz", timeout=5.0)
    return reply.json().get("scheduler") if reply.status_code == 200 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="llama,magnitude-default")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--trace", choices=sorted(TRACES), default="single")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-server", default=str(ROOT / ".cache" / "llama.cpp" / "build" / "bin" / "llama-server"))
    p.add_argument("--llama-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--out-dir", default=str(ROOT / "out" / "bench-paired-single"))
    args = p.parse_args(argv)
    args.budget = {}  # server_command's per-variant budget overrides: none here
    systems = args.systems.split(",")
    if len(systems) < 2:
        p.error("--systems: name at least two, the first is the one the others are compared with")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf = rb.bundled_gguf()
    servers = {}
    try:
        for system in systems:
            servers[system] = start(system, args, gguf, out_dir)
        for system, (proc, url) in servers.items():
            rb.wait_ready(url, proc)
        for system, (_, url) in servers.items():  # one unmeasured request each: first-request effects
            run_trace(url, "single", -1, system, out_dir)
        unit = TRACES[args.trace][2]
        figures: dict[str, list[float]] = {s: [] for s in systems}
        for round_ in range(args.rounds):
            order = systems if round_ % 2 == 0 else systems[::-1]
            for system in order:
                figures[system].append(run_trace(servers[system][1], args.trace, round_, system, out_dir))
            print(f"round {round_}: " + "  ".join(f"{s} {figures[s][-1]:.3f} {unit}" for s in systems), flush=True)
        limits = {system: scheduler_limits(url) for system, (_, url) in servers.items()}
    finally:
        for proc, _ in servers.values():
            rb.stop_server(proc)
    first = systems[0]
    summary = {}
    for system in systems:
        ratios = [t / f for t, f in zip(figures[system], figures[first])]
        summary[system] = {unit: figures[system], "median": statistics.median(figures[system]),
                           f"median_ratio_to_{first}": statistics.median(ratios),
                           "ratio_range": [min(ratios), max(ratios)], "scheduler": limits[system]}
        print(f"{system:24s} median {summary[system]['median']:7.3f} {unit}  paired ratio to {first}: "
              f"median {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})"
              + (f"  limits {limits[system]}" if limits[system] else ""))
    (out_dir / "summary.json").write_text(json.dumps({"args": vars(args), "results": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
