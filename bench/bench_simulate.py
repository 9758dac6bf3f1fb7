"""Benchmark: `magnitude simulate` on a 10,000-request mixed trace (wall time, steps per second).

    PYTHONPATH=server .venv/bin/python bench/bench_simulate.py [--n 10000] [--seed 0]

Times the three stages separately: generating the trace, simulating it (the real Scheduler on a
virtual clock with the linear cost model), and building + serialising the JSON report.
Runs the CLI once more end to end (`magnitude simulate TRACE --json`) for the total.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import time

from magnitude.cli.main import main as cli
from magnitude.policy.load import resolve_config
from magnitude.sim.cost import LinearCost
from magnitude.sim.report import build_report, dump_report
from magnitude.sim.scenarios import ScenarioOptions, generate
from magnitude.sim.simulate import simulate
from magnitude.sim.trace import write_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    t0 = time.perf_counter()
    records = generate("mixed", ScenarioOptions(seed=a.seed, n=a.n))
    t1 = time.perf_counter()
    result = simulate(records, resolve_config(), LinearCost())
    t2 = time.perf_counter()
    text = dump_report(build_report(result))
    t3 = time.perf_counter()
    steps = len(result.steps)
    print(f"mixed trace: {a.n} requests, {steps} steps, {len(result.events)} events, "
          f"{result.end_time:.1f} s simulated, report {len(text) / 1e6:.1f} MB")
    print(f"generate {t1 - t0:.2f} s | simulate {t2 - t1:.2f} s ({steps / (t2 - t1):,.0f} steps/s, "
          f"{result.end_time / (t2 - t1):,.0f}x real time) | report {t3 - t2:.2f} s")

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "mixed.jsonl")
        write_trace(records, path)
        sink = io.StringIO()
        t4 = time.perf_counter()
        with contextlib.redirect_stdout(sink):
            rc = cli(["simulate", path, "--json"])
        t5 = time.perf_counter()
    assert rc == 0
    print(f"`magnitude simulate mixed.jsonl --json` end to end: {t5 - t4:.2f} s wall ({steps / (t5 - t4):,.0f} steps/s)")


if __name__ == "__main__":
    main()
