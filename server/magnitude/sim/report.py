"""The simulation report (DESIGN §3 contract): summary, tenants, classes, requests, steps, events.

`P` = {"p50", "p90", "p99", "max", "mean"} in seconds (steps under `unit`); times a request did
not reach are null. Pure: builds a dict; `write_report` is the only I/O and is atomic.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from magnitude.engine.request import Request, RequestStatus
from magnitude.sim.simulate import SimResult
from magnitude.sim.trace import TraceRecord, write_atomic

P_KEYS = ("p50", "p90", "p99", "max", "mean")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values: Iterable[float]) -> dict[str, float | None]:
    v = sorted(values)
    if not v:
        return dict.fromkeys(P_KEYS)
    return {
        "p50": percentile(v, 0.50),
        "p90": percentile(v, 0.90),
        "p99": percentile(v, 0.99),
        "max": v[-1],
        "mean": sum(v) / len(v),
    }


def _status(req: Request) -> str:
    return req.status.value if req.status.is_terminal else "unfinished"


def _group(pairs: list[tuple[TraceRecord, Request]], duration: float) -> dict:
    reqs = [r for _, r in pairs]
    counts = {s: 0 for s in ("finished", "rejected", "cancelled", "timed_out")}
    for r in reqs:
        if r.status.is_terminal:
            counts[r.status.value] += 1
    out_tokens = sum(r.num_output_tokens for r in reqs)
    itl = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:])]
    # How long each request waited before it first ran, or before it left without running.
    waits = [
        (r.admitted_time if r.admitted_time is not None else r.finish_time) - r.arrival_time
        for r in reqs
        if r.admitted_time is not None or r.finish_time is not None
    ]
    return {
        "requests": len(reqs),
        **counts,
        "output_tokens": out_tokens,
        "duration": duration,
        "throughput_tokens_per_s": out_tokens / duration if duration > 0 else 0.0,
        "preemptions": sum(r.num_preemptions for r in reqs),
        "ttft": summarize(r.first_token_time - r.arrival_time for r in reqs if r.first_token_time is not None),
        "itl": summarize(itl),
        "queue_time": summarize(r.admitted_time - r.arrival_time for r in reqs if r.admitted_time is not None),
        "e2e": summarize(
            r.finish_time - r.arrival_time
            for r in reqs
            if r.status is RequestStatus.FINISHED and r.finish_time is not None
        ),
        "max_wait": max(waits) if waits else None,
    }


def build_report(result: SimResult, include_steps: bool = True, include_events: bool = True) -> dict:
    pairs = result.requests
    start = min((rec.arrival for rec, _ in pairs), default=0.0)
    duration = max(0.0, result.end_time - start)
    summary = _group(pairs, duration)
    summary.pop("max_wait")
    by_tenant: dict[str, list] = {}
    by_class: dict[str, list] = {}
    for rec, req in pairs:
        by_tenant.setdefault(req.tenant, []).append((rec, req))
        by_class.setdefault(req.priority_class, []).append((rec, req))
    return {
        "config": result.config.to_document(),
        "cost_model": result.cost_model,
        "summary": summary,
        "tenants": {k: _group(v, duration) for k, v in sorted(by_tenant.items())},
        "classes": {k: _group(v, duration) for k, v in sorted(by_class.items())},
        "speculation": result.speculation,  # None without draftModel (sim/speculation.py)
        # The limits derived again from the replay's served steps (sim/served_limits.py); `config` has the first.
        "limits_changes": [{"t": t, **limits.to_document()} for t, limits in result.limits_changes],
        "requests": [
            {
                "id": req.request_id,
                "tenant": req.tenant,
                "priority_class": req.priority_class,
                "arrival": req.arrival_time,
                "admitted": req.admitted_time,
                "first_token": req.first_token_time,
                "finished": req.finish_time,
                "status": _status(req),
                "reason": req.finish_reason,
                "output_tokens": req.num_output_tokens,
                "preemptions": req.num_preemptions,
            }
            for _, req in pairs
        ],
        "steps": [
            {
                "t": s.t,
                "duration": s.duration,
                "decode": s.decode,
                "prefill": [list(p) for p in s.prefill],
                "preempted": [list(p) for p in s.preempted],
                "kv_used_blocks": s.kv_used_blocks,
                "kv_total_blocks": s.kv_total_blocks,
                "waiting": s.waiting,
                "running": s.running,
            }
            for s in result.steps
        ]
        if include_steps
        else [],
        "events": [e.to_document() for e in result.events] if include_events else [],
    }


def dump_report(report: dict) -> str:
    return json.dumps(report, separators=(",", ":")) + "\n"


def write_report(report: dict, path: str | Path) -> None:
    write_atomic(path, dump_report(report))
