"""`simulate --report DIR`: report.json plus plots a person would rather look at than read.

- timeline.png: per step, decode sequences and prefill tokens (stacked), and KV occupancy;
- queue_time_by_tenant.png: the distribution (CDF) of queue time per tenant;
- ttft_by_class.png: the CDF of time to first token per priority class.
Files are rendered into a temporary folder inside DIR and renamed into place, so DIR never
holds a half-written report. matplotlib (Agg) is imported only here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from magnitude.sim.report import dump_report


def _cdf(ax, values: list[float], label: str) -> None:
    v = sorted(values)
    if not v:
        return
    ys = [(i + 1) / len(v) for i in range(len(v))]
    ax.step(v, ys, where="post", label=f"{label} (n={len(v)})")


def _timeline(plt, report: dict, unit: str, path: Path) -> None:
    steps = report["steps"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, constrained_layout=True)
    t = [s["t"] for s in steps]
    widths = [max(s["duration"], 1e-9) for s in steps]
    decodes = [len(s["decode"]) for s in steps]
    prefill = [sum(n for _, n in s["prefill"]) for s in steps]
    ax1.bar(t, decodes, width=widths, align="edge", label="decode sequences", color="#4c72b0")
    ax1.bar(t, prefill, width=widths, align="edge", bottom=decodes, label="prefill tokens", color="#dd8452")
    pre = [s["t"] for s in steps if s["preempted"]]
    if pre:
        ax1.plot(pre, [0] * len(pre), "rx", label="preemption")
    ax1.set_ylabel("tokens in step")
    ax1.set_title("Step composition")
    ax1.legend(loc="upper right")
    kv = [100.0 * s["kv_used_blocks"] / max(1, s["kv_total_blocks"]) for s in steps]
    ax2.plot(t, kv, color="#55a868", label="KV blocks used (%)")
    ax2.set_ylabel("KV occupancy (%)")
    ax2.set_ylim(0, 105)
    ax3 = ax2.twinx()
    ax3.plot(t, [s["waiting"] for s in steps], color="#c44e52", alpha=0.7, label="waiting")
    ax3.plot(t, [s["running"] for s in steps], color="#8172b2", alpha=0.7, label="running")
    ax3.set_ylabel("requests")
    lines = ax2.get_lines() + ax3.get_lines()
    ax2.legend(lines, [l.get_label() for l in lines], loc="upper right")
    ax2.set_xlabel(f"time ({unit})")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cdf_plot(plt, report: dict, group: str, field: str, title: str, unit: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    by: dict[str, list[float]] = {}
    key = "tenant" if group == "tenants" else "priority_class"
    for r in report["requests"]:
        start = r["admitted"] if field == "queue_time" else r["first_token"]
        if start is not None:
            by.setdefault(r[key], []).append(start - r["arrival"])
    for name in sorted(by):
        _cdf(ax, by[name], name)
    ax.set_xlabel(f"{field.replace('_', ' ')} ({unit})")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if by:
        ax.legend(loc="lower right")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report_dir(report: dict, directory: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    unit = "steps" if report.get("cost_model") == "unit" else "s"
    tmp = Path(tempfile.mkdtemp(prefix=".report-", dir=out))
    try:
        (tmp / "report.json").write_text(dump_report(report))
        _timeline(plt, report, unit, tmp / "timeline.png")
        _cdf_plot(plt, report, "tenants", "queue_time", "Queue time by tenant", unit, tmp / "queue_time_by_tenant.png")
        _cdf_plot(plt, report, "classes", "ttft", "Time to first token by priority class", unit, tmp / "ttft_by_class.png")
        written = []
        for f in sorted(tmp.iterdir()):
            os.replace(f, out / f.name)
            written.append(out / f.name)
        return written
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
