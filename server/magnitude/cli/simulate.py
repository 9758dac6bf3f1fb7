"""`magnitude simulate TRACE.jsonl`: replay a trace through the scheduler, print or write the report."""

from __future__ import annotations

import argparse
import sys

from magnitude.cli.errors import UsageError
from magnitude.cli.config_file import load_config
from magnitude.sim.cost import CostModelError, load_cost_model
from magnitude.sim.report import build_report, dump_report
from magnitude.sim.simulate import simulate
from magnitude.sim.speculation import SpecConfigError, SpecModel
from magnitude.sim.trace import TraceError, load_trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="JSONL trace, one request a line (see `magnitude trace`)")
    p.add_argument("--config", default=None, help="engine config file (YAML or JSON)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key by its dotted camelCase path, e.g. scheduler.tokenBudget=16")
    p.add_argument("--cost-model", default="linear", help="unit | linear | FILE.json (default linear)")
    p.add_argument("--json", action="store_true", help="print the full JSON report on stdout")
    p.add_argument("--report", default=None, metavar="DIR", help="write report.json and plots into DIR")
    p.add_argument("--spec-acceptance", action="append", default=[], metavar="A|CLASS=A",
                   help="with a draftModel: the probability that each draft is accepted (0..1; drafts after a "
                        "rejection are dropped), for every class, or CLASS=A for one priority class (repeatable)")
    p.add_argument("--spec-draft-seconds", type=float, default=None, metavar="S",
                   help="draftModel.method draft: the draft model's cost per draft forward (one per lookahead "
                        "position per step); prompt lookup (ngram) costs nothing to propose")
    p.add_argument("--spec-seed", type=int, default=0, help="seed of the acceptance draws (default 0)")
    p.add_argument("--compare-speculation", action="store_true",
                   help="run the trace three times, draftModel.mode off, on and auto, and print them side by side")


def spec_model(args: argparse.Namespace) -> SpecModel | None:
    """The speculation knobs, or None when none was given; bad values are usage errors."""
    if not args.spec_acceptance and args.spec_draft_seconds is None:
        return None
    default: float | None = None
    per_class: dict[str, float] = {}
    for item in args.spec_acceptance:
        name, _, value = item.rpartition("=")
        try:
            a = float(value)
        except ValueError:
            raise UsageError(f"--spec-acceptance {item}: expected A or CLASS=A with A a number in 0..1") from None
        if name:
            per_class[name] = a
        else:
            default = a
    if default is None:
        raise UsageError("--spec-acceptance A: give the acceptance of every class (CLASS=A then sets one class)")
    try:
        return SpecModel(default, per_class, args.spec_draft_seconds, args.spec_seed)
    except SpecConfigError as e:
        raise UsageError(str(e)) from e


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.sets)
    spec = spec_model(args)
    if args.compare_speculation:
        return compare_speculation(args, config, spec)
    try:
        cost = load_cost_model(args.cost_model, config.kv_cache.block_size)
        records = load_trace(args.trace)
        result = simulate(records, config, cost, speculation=spec)
    except (TraceError, CostModelError, SpecConfigError) as e:
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


def compare_speculation(args: argparse.Namespace, config, spec: SpecModel | None) -> int:
    """The same trace with draftModel.mode off, on and auto (everything else as configured)."""
    if config.draft_model is None:
        raise UsageError("--compare-speculation: the config has no draftModel (set draftModel.method and "
                         "draftModel.numSpeculativeTokens)")
    if args.report:
        raise UsageError("--compare-speculation writes no --report directory: run one mode with --set draftModel.mode=M")
    reports: dict[str, dict] = {}
    try:
        cost = load_cost_model(args.cost_model, config.kv_cache.block_size)
        records = load_trace(args.trace)
        for mode in ("off", "on", "auto"):
            cfg = config.model_copy(update={"draft_model": config.draft_model.model_copy(update={"mode": mode})})
            reports[mode] = build_report(simulate(records, cfg, cost, keep_events=False, speculation=spec),
                                         include_steps=False, include_events=False)
    except (TraceError, CostModelError, SpecConfigError) as e:
        raise UsageError(str(e)) from e
    if args.json:
        sys.stdout.write(dump_report({m: {k: r[k] for k in ("summary", "classes", "speculation")}
                                      for m, r in reports.items()}))
    else:
        sys.stdout.write(format_comparison(reports, cost.name))
    return 0


def format_comparison(reports: dict[str, dict], cost_name: str) -> str:
    def q(v: dict, key: str) -> str:
        return "-" if v[key] is None else f"{v[key]:.3f}"

    rows = [("mode", "tokens/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "E2E p50", "E2E p99",
             "acceptance", "tokens/step", "switches")]
    for mode, r in reports.items():
        s, sp = r["summary"], r["speculation"] or {}
        rows.append((mode, f"{s['throughput_tokens_per_s']:.1f}", q(s["ttft"], "p50"), q(s["ttft"], "p99"),
                     q(s["itl"], "p50"), q(s["itl"], "p99"), q(s["e2e"], "p50"), q(s["e2e"], "p99"),
                     "-" if sp.get("acceptance") is None else f"{sp['acceptance']:.2f}",
                     "-" if sp.get("tokens_per_step") is None else f"{sp['tokens_per_step']:.2f}",
                     str(sp.get("switches", 0))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    return "\n".join(lines) + f"\n({cost_name} cost model; acceptance = accepted / proposed drafts)\n"


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
    sp = report.get("speculation")
    if sp:
        acc = "-" if sp["acceptance"] is None else f"{sp['acceptance']:.2f}"
        tps = "-" if sp["tokens_per_step"] is None else f"{sp['tokens_per_step']:.2f}"
        lines.append(f"speculation {sp['method']} k={sp['num_speculative_tokens']} mode {sp['mode']}: "
                     f"acceptance {acc}, tokens/step {tps}, drafted steps {sp['drafted_steps']}, "
                     f"switches {sp['switches']}")
    return "\n".join(lines) + "\n"
