"""Per-step cost of the request records and telemetry (issue 16) against `Scheduler.schedule()`.

    PYTHONPATH=server .venv/bin/python bench/bookkeeping_overhead.py [--running 256] [--waiting 2000] [--steps 500]

Builds bench_scheduler's scheduler (N running decoders, M waiting, real token ids, prefix caching
on), opens a timeline for every request as the engine does, then per step times, around the same
schedule() -> update_from_output() loop the engine loop runs:
- `schedule()` itself (the reference);
- `RequestLog.observe_step` (the decision log and the timelines: events, chunks, first tokens);
- `EngineMetrics.observe_step`: every per-step series (step duration, gauges, the occupancy
  histograms, prefix-cache and allocation-failure counters, preemptions), old ones included;
- `stats_of`, the scheduler snapshot the engine loop took per step before issue 16 (shown apart:
  not part of the bookkeeping measured against the target).
Prints medians, each as a fraction of schedule()'s median; the target is bookkeeping under 5 %.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scheduler import build  # noqa: E402

from magnitude.engine.output import RunnerOutput, SampledToken  # noqa: E402
from magnitude.server.engine_loop import stats_of  # noqa: E402
from magnitude.server.metrics import EngineMetrics  # noqa: E402
from magnitude.server.timeline import RequestLog  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--waiting", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--tenants", type=int, default=4)
    a = ap.parse_args()
    s, t = build(a.running, a.waiting, a.tenants, max_tokens=a.steps + 100)
    log = RequestLog(lambda: t)
    for req in [*s.running.values(), *s.queue]:
        log.open(req.request_id, arrival=req.arrival_time, enqueued=req.arrival_time,
                 prompt_tokens=req.num_prompt_tokens, priority_class="standard", tenant=req.tenant)
    s.drain_events()
    metrics = EngineMetrics(tenant_labels=[f"t{i}" for i in range(a.tenants)], compat="vllm")
    metrics.register_decisions(log.decision_counts)
    schedule, timeline, telemetry, snapshot = [], [], [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        plan = s.schedule(t)
        t1 = time.perf_counter()
        start, t = t, t + 0.02
        updates = s.update_from_output(plan, RunnerOutput({q.request_id: [SampledToken(5)] for q in plan.seqs if q.sample}), t)
        t2 = time.perf_counter()
        log.observe_step(start, t, plan, s.drain_events(), updates)
        t3 = time.perf_counter()
        stats = stats_of(s, t, 0.02, plan)
        t4 = time.perf_counter()
        metrics.observe_step(stats)
        t5 = time.perf_counter()
        schedule.append(t1 - t0)
        timeline.append(t3 - t2)
        snapshot.append(t4 - t3)
        telemetry.append(t5 - t4)
        assert len(plan.seqs) == a.running, "every step must decode every running request"
    ref = statistics.median(schedule)
    print(f"running={a.running} waiting={a.waiting} tenants={a.tenants} steps={a.steps}")
    print(f"{'schedule():':<40} median {ref * 1e3:.3f} ms")
    rows = (("RequestLog.observe_step:", timeline), ("EngineMetrics.observe_step:", telemetry),
            ("bookkeeping (the two above):", [x + y for x, y in zip(timeline, telemetry)]),
            ("stats_of (the snapshot, pre-existing):", snapshot))
    for name, xs in rows:
        med = statistics.median(xs)
        print(f"{name:<40} median {med * 1e3:.3f} ms = {med / ref:.1%} of schedule()")
    print("target: bookkeeping < 5% of schedule()")


if __name__ == "__main__":
    main()
