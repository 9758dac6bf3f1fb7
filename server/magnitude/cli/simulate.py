"""`magnitude simulate TRACE.jsonl`: replay a trace through the scheduler, print or write the report."""

from __future__ import annotations

import argparse
import sys

from magnitude.cli.errors import UsageError
from magnitude.cli.config_file import load_config
from magnitude.sim.cost import CostModelError, load_cost_model
from magnitude.sim.report import build_report, dump_report
from magnitude.sim.simulate import simulate
from magnitude.sim.trace import TraceError, load_trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="JSONL trace, one request a line (see `magnitude trace`)")
    p.add_argument("--config", default=None, help="engine config file (YAML or JSON)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key by its dotted camelCase path, e.g. scheduler.tokenBudget=16")
    p.add_argument("--cost-model", default="linear", help="unit | linear | FILE.json (default linear)")
    p.add_argument("--json", action="store_true", help="print the full JSON report on stdout")
    p.add_argument("--report", default=None, metavar="DIR", help="write report.json and plots into DIR")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.sets)
    if config.draft_model is not None:
        # Refused rather than replayed as if every draft were rejected: the cost model has no speculation yet.
        raise UsageError("draftModel: the simulator does not model speculation yet; remove draftModel from the config")
    try:
        cost = load_cost_model(args.cost_model, config.kv_cache.block_size)
        records = load_trace(args.trace)
        result = simulate(records, config, cost)
    except (TraceError, CostModelError) as e:
        raise UsageError(str(e)) from e
    report = build_report(result)
    if args.report:
        from magnitude.sim.plots import write_report_dir  # matplotlib only when asked

        try:
            write_report_dir(report, args.report)
        except OSError as e:
            raise UsageError(f"--report {args.report}: {e.strerror or e}") from e
    if args.json:
        sys.stdout.write(dump_report(report))
    else:
        sys.stdout.write(format_summary(report))
    return 0


def format_summary(report: dict) -> str:
    s = report["summary"]

    def p(name: str) -> str:
        v = s[name]
        if v["p50"] is None:
            return f"{name:<11} -"
        return f"{name:<11} p50 {v['p50']:.3f}  p90 {v['p90']:.3f}  p99 {v['p99']:.3f}  max {v['max']:.3f}"

    lines = [
        f"requests {s['requests']}: finished {s['finished']}, rejected {s['rejected']}, "
        f"cancelled {s['cancelled']}, timed out {s['timed_out']}; preemptions {s['preemptions']}",
        f"duration {s['duration']:.3f}, output tokens {s['output_tokens']}, "
        f"throughput {s['throughput_tokens_per_s']:.1f} tokens/s ({report['cost_model']} cost model)",
        p("ttft"), p("itl"), p("queue_time"), p("e2e"),
    ]
    for name, t in report["tenants"].items():
        ttft = t["ttft"]["p50"]
        lines.append(
            f"tenant {name}: {t['requests']} requests, finished {t['finished']}, rejected {t['rejected']}, "
            f"ttft p50 {'-' if ttft is None else f'{ttft:.3f}'}, max wait "
            f"{'-' if t['max_wait'] is None else format(t['max_wait'], '.3f')}"
        )
    return "\n".join(lines) + "\n"
