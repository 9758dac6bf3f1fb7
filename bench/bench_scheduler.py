"""Benchmark: Scheduler.schedule() with N running (decoding) and M waiting requests.

    PYTHONPATH=server .venv/bin/python bench/bench_scheduler.py [--running 256] [--waiting 2000] [--steps 500]

Prints the median / p90 wall time of schedule() and of update_from_output() per step, and the
ratio of the median to the 1 ms target. Requests carry real token ids (the engine path, prefix
caching on); running ones never finish, so every measured step has the same shape.
"""

from __future__ import annotations

import argparse
import statistics
import time

from magnitude.engine.output import RunnerOutput, SampledToken
from magnitude.engine.request import Request
from magnitude.engine.sampling import SamplingParams
from magnitude.engine.scheduler import Scheduler
from magnitude.policy.load import resolve_config


def build(running: int, waiting: int, tenants: int, max_tokens: int = 1000) -> tuple[Scheduler, float]:
    config = resolve_config(None, [
        f"scheduler.maxSequences={running}",
        "scheduler.tokenBudget=2048",
        f"admission.maxQueuedRequests={running + waiting + 1}",
        "admission.maxQueuedTokens=1000000000",
        "admission.maxTenantQueueShare=1",
        "kvCache.blockSize=16",
        f"kvCache.numBlocks={running * (8 + (128 + max_tokens) // 16) + 64}",
    ])
    s = Scheduler(config)
    t = 0.0

    def req(i: int) -> Request:
        prompt = [1 + (i * 7 + j) % 30000 for j in range(128)]
        return Request(f"r{i}", prompt, len(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), t,
                       tenant=f"t{i % tenants}", cache_key="bench")

    for i in range(running):
        d = s.add_request(req(i), t)
        assert d.accepted, d
    while len(s.running) < running or any(r.num_output_tokens == 0 for r in s.running.values()):
        plan = s.schedule(t)
        t += 0.02
        s.update_from_output(plan, RunnerOutput({q.request_id: [SampledToken(5)] for q in plan.seqs if q.sample}), t)
    for i in range(running, running + waiting):
        d = s.add_request(req(i), t)
        assert d.accepted, d
    return s, t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--waiting", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--tenants", type=int, default=4)
    a = ap.parse_args()
    s, t = build(a.running, a.waiting, a.tenants, max_tokens=a.steps + 100)
    sched_times, update_times = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        plan = s.schedule(t)
        t1 = time.perf_counter()
        out = RunnerOutput({q.request_id: [SampledToken(5)] for q in plan.seqs if q.sample})
        t += 0.02
        t2 = time.perf_counter()
        s.update_from_output(plan, out, t)
        t3 = time.perf_counter()
        s.drain_events()
        sched_times.append(t1 - t0)
        update_times.append(t3 - t2)
        assert len(plan.seqs) == a.running, "every step must decode every running request"
    st = s.stats()
    assert st.running == a.running and st.waiting == a.waiting

    def fmt(xs: list[float]) -> str:
        xs = sorted(xs)
        return f"median {statistics.median(xs) * 1e3:.3f} ms  p90 {xs[int(len(xs) * 0.9)] * 1e3:.3f} ms"

    med = statistics.median(sched_times)
    print(f"running={a.running} waiting={a.waiting} tenants={a.tenants} steps={a.steps}")
    print(f"schedule():           {fmt(sched_times)}  ({med * 1e3:.3f} ms = {med / 1e-3:.2f}x the 1 ms target)")
    print(f"update_from_output(): {fmt(update_times)}")
    print(f"per step (both):      {statistics.median([x + y for x, y in zip(sched_times, update_times)]) * 1e3:.3f} ms median")


if __name__ == "__main__":
    main()
