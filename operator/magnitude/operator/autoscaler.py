"""The autoscaling and load-shedding policy: pure functions from observed load to a decision.

One tick takes every pod's scraped load, the spec's targets and what earlier ticks remembered,
and returns the replica count, the priority classes to shed, the new memory, and (when scaling
down) pod-deletion costs so the least-loaded pods go first. Rules:

* HPA-style ratio: desired = ceil(pods_with_metrics x max(kv/targetKv, queueP90/targetQueue)),
  unchanged while every ratio is within 1 +/- tolerance.
* Stabilization as in the HPA: scale up to the *lowest* recommendation of the up-window (0 s by
  default: fast), scale down to the *highest* of the down-window (300 s: slow); one step grows by
  at most `maxScaleUpFactor`; the result is clamped to [minReplicas, maxReplicas].
* No scale-up while pods are pending or loading (their capacity is already on its way). A pod
  that will not become ready by waiting is not on its way: one whose /readyz reports a terminal
  phase (`quantization_rejected`, `failed`, `dead`), or one not ready for longer than the load
  timeout (`spec.modelLoadTimeoutSeconds`). It no longer holds scaling or shedding, and the
  Scaling condition names it and why (reason `PodsStuck` when no pod serves at all).
* Missing or stale metrics hold the current size and say so. A ready pod without usable metrics
  (it did not answer, answered garbage, or its last scrape is stale) blocks scaling *down*: its
  load is unknown, and the pod it would remove first is that very pod. Scaling up still follows
  the pods that do report. The condition names each such pod and why (`PodLoad.problem`).
* Shedding only when the service cannot grow (autoscaling off, or at maxReplicas): one more class
  (least important first) every `stepSeconds` while overloaded, one class fewer every `stepSeconds`
  while calm; the band between the on and off thresholds holds (hysteresis).

No kopf, kubernetes, prometheus_client or I/O here; time is a parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from magnitude.operator.spec import Autoscaling, LoadShedding, ModelServiceSpec

MAX_RECOMMENDATIONS = 512
# Engine decisions worth citing in a condition: what made requests wait, lose work or fail. Admits,
# finishes, releases and swaps are routine; cancels are the clients'; shed is the operator's own.
CITED_DECISION_KINDS = frozenset({"defer", "preempt", "reject", "timeout"})
CITED_DECISIONS = 3

# Scaling reasons (the `Scaling` condition's reason and the Event reason when the size changes).
SCALED_UP = "ScaledUp"
SCALED_DOWN = "ScaledDown"
STABLE = "WithinTolerance"
STABILIZING = "StabilizingScaleDown"
AT_MAX = "AtMaxReplicas"
AT_MIN = "AtMinReplicas"
PODS_PENDING = "PodsPending"
PODS_STUCK = "PodsStuck"
METRICS_UNAVAILABLE = "MetricsUnavailable"
EXTERNAL = "AutoscalingDisabled"

# Shedding reasons.
SHED_STARTED = "SheddingStarted"
SHED_ESCALATED = "SheddingEscalated"
SHED_REDUCED = "SheddingReduced"
SHED_STOPPED = "SheddingStopped"
SHED_HOLDING = "SheddingHeld"
NOT_SHEDDING = "NotShedding"
SHED_DISABLED = "SheddingDisabled"


# Engine /readyz phases a pod does not leave by itself (server/magnitude/server/async_engine.py).
TERMINAL_PHASES = frozenset({"quantization_rejected", "failed", "dead"})


@dataclass(frozen=True)
class PodLoad:
    """One pod's scraped load. `queue_buckets` are (upper bound, observations) since the last scrape."""

    name: str
    ready: bool
    age: float | None = None  # seconds since the scrape; None: never scraped
    kv_usage: float | None = None
    waiting: float = 0.0
    running: float = 0.0
    queue_buckets: tuple[tuple[float, float], ...] = ()
    problem: str | None = None  # why the latest scrape gave nothing usable (None: it did, or none was due)
    phase: str | None = None  # a not-ready pod's /readyz phase (None: unknown)
    not_ready_since: float | None = None  # Unix seconds a not-ready pod became not ready (None: unknown)
    # The engine's scheduler decisions since the last scrape: ((kind, reason), count), from
    # magnitude_decisions_total.
    decisions: tuple[tuple[tuple[str, str], float], ...] = ()

    def stuck(self, now: float, load_timeout: float) -> str | None:
        """Why this not-ready pod will not become ready by waiting, or None while it may still load."""
        if self.ready:
            return None
        if self.phase in TERMINAL_PHASES:
            return f"/readyz phase {self.phase}"
        if self.not_ready_since is not None and now - self.not_ready_since > load_timeout:
            return (f"not ready for {now - self.not_ready_since:.0f}s, past spec.modelLoadTimeoutSeconds "
                    f"{load_timeout:g}")
        return None

    def fresh(self, max_age: float) -> bool:
        """Ready with a usable scrape no older than `max_age` (finite values only: the scraper
        refuses others, and the policy does not take that on trust)."""
        return (self.ready and self.age is not None and self.age <= max_age and self.kv_usage is not None
                and all(math.isfinite(x) for x in (self.kv_usage, self.waiting, self.running)))

    def why_unavailable(self, max_age: float) -> str:
        if self.problem:
            return self.problem
        if self.age is None:
            return "not scraped yet"
        if self.age > max_age:
            return f"last good scrape {self.age:.0f}s ago (max age {max_age:g}s)"
        return "no magnitude_kv_cache_usage_ratio"


@dataclass(frozen=True)
class Load:
    """Aggregated load over the pods with fresh metrics."""

    fresh_pods: int
    ready_pods: int
    kv_usage: float | None = None
    waiting: float | None = None
    running: float | None = None
    queue_time_p90: float | None = None
    unavailable: tuple[tuple[str, str], ...] = ()  # ready pods without usable metrics: (name, why)
    decisions: tuple[tuple[tuple[str, str], float], ...] = ()  # cited kinds, summed over pods, most first

    def decisions_note(self) -> str:
        """`engine decisions since the last tick: defer/kv_blocks 120, preempt/kv_blocks 14`, or ""."""
        if not self.decisions:
            return ""
        return "engine decisions since the last tick: " + ", ".join(
            f"{kind}/{reason} {n:g}" for (kind, reason), n in self.decisions[:CITED_DECISIONS])

    @property
    def available(self) -> bool:
        return self.fresh_pods > 0 and self.kv_usage is not None

    def unavailable_note(self) -> str:
        """`metrics unavailable from pod a (why); pod b (why)`, or "" when every ready pod reported."""
        if not self.unavailable:
            return ""
        return "metrics unavailable from " + "; ".join(f"pod {name} ({why})" for name, why in self.unavailable)


@dataclass(frozen=True)
class Memory:
    """What the policy carries from one tick to the next (persisted in status)."""

    recommendations: tuple[tuple[float, int], ...] = ()  # change points: (time, replicas)
    shed_classes: tuple[str, ...] = ()
    shed_changed_at: float | None = None
    overloaded_since: float | None = None
    calm_since: float | None = None


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    message: str
    shed_classes: tuple[str, ...]
    shed_reason: str
    shed_message: str
    memory: Memory
    load: Load
    deletion_costs: dict[str, int] = field(default_factory=dict)

    @property
    def shedding(self) -> bool:
        return bool(self.shed_classes)


def histogram_quantile(q: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """Quantile of per-bucket (not cumulative) counts, interpolated linearly inside a bucket as
    Prometheus' histogram_quantile does; the +Inf bucket answers with the largest finite bound."""
    ordered = sorted(buckets)
    total = sum(c for _, c in ordered)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    lower = 0.0
    for upper, count in ordered:
        if count > 0 and seen + count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - seen) / count
        seen += count
        if not math.isinf(upper):
            lower = upper
    return lower


def aggregate(pods: tuple[PodLoad, ...] | list[PodLoad], max_age: float) -> Load:
    """Mean KV usage, summed queues and the merged queue-time p90 over ready pods with fresh metrics."""
    ready = [p for p in pods if p.ready]
    fresh = [p for p in ready if p.fresh(max_age)]
    unavailable = tuple((p.name, p.why_unavailable(max_age)) for p in ready if not p.fresh(max_age))
    if not fresh:
        return Load(fresh_pods=0, ready_pods=len(ready), unavailable=unavailable)
    merged: dict[float, float] = {}
    decided: dict[tuple[str, str], float] = {}
    for p in fresh:
        for upper, count in p.queue_buckets:
            merged[upper] = merged.get(upper, 0.0) + count
        for key, count in p.decisions:
            if key[0] in CITED_DECISION_KINDS and count > 0:
                decided[key] = decided.get(key, 0.0) + count
    return Load(
        fresh_pods=len(fresh),
        ready_pods=len(ready),
        kv_usage=sum(p.kv_usage or 0.0 for p in fresh) / len(fresh),
        waiting=sum(p.waiting for p in fresh),
        running=sum(p.running for p in fresh),
        queue_time_p90=histogram_quantile(0.9, tuple(merged.items())),
        unavailable=unavailable,
        decisions=tuple(sorted(decided.items(), key=lambda kv: (-kv[1], kv[0]))),
    )


def usage_ratio(load: Load, targets: Autoscaling) -> float:
    """The larger of the KV and queue-time ratios to their targets (1.0 = exactly on target)."""
    ratios = [(load.kv_usage or 0.0) / targets.target_kv_usage]
    if load.queue_time_p90 is not None:
        ratios.append(load.queue_time_p90 / targets.target_queue_time_seconds)
    return max(ratios)


def shed_order(spec: ModelServiceSpec) -> tuple[str, ...]:
    """Classes in the order they are shed: least important (highest shedOrder/priority) first,
    never the most important one unless loadShedding.maxShedClasses says so."""
    order = spec.scheduler.shed_order()
    limit = spec.load_shedding.max_shed_classes
    limit = len(order) - 1 if limit is None else min(limit, len(order))
    return tuple(order[:limit])


def deletion_costs(pods: tuple[PodLoad, ...] | list[PodLoad], max_age: float) -> dict[str, int]:
    """controller.kubernetes.io/pod-deletion-cost per ready pod: in-flight work, so the ReplicaSet
    removes the least-loaded pods first. Pods without fresh metrics cost 0 (their load is unknown)."""
    costs: dict[str, int] = {}
    for p in pods:
        if not p.ready:
            continue
        if not p.fresh(max_age):
            costs[p.name] = 0
        else:
            costs[p.name] = int(round(1000 * (p.running + p.waiting) + 100 * p.kv_usage))
    return costs


def stuck_note(stuck: list[tuple[str, str]]) -> str:
    """`; not waiting for pod a (why); pod b (why)`, or "" when every not-ready pod may still load."""
    return ("; not waiting for " + "; ".join(f"pod {name} ({why})" for name, why in stuck)) if stuck else ""


def _scale(spec: ModelServiceSpec, current: int, pods: tuple[PodLoad, ...], load: Load, memory: Memory,
           now: float) -> tuple[int, str, str, Memory]:
    a = spec.autoscaling
    lo, hi = spec.min_replicas, spec.max_replicas
    stuck = [(p.name, why) for p in pods if (why := p.stuck(now, spec.model_load_timeout_seconds)) is not None]
    note = stuck_note(stuck)
    if not a.enabled:
        want = spec.replicas
        return (want, EXTERNAL, f"autoscaling is off; spec.replicas decides ({want}){note}",
                replace(memory, recommendations=()))
    # Pods still on their way: not ready and not stuck, plus those the ReplicaSet has yet to create.
    not_ready = sum(1 for p in pods if not p.ready) - len(stuck) + max(0, current - len(pods))
    if current > 0 and not load.available and load.ready_pods == 0 and not_ready > 0:
        return _clamp_hold(current, lo, hi, PODS_PENDING, f"{not_ready} pod(s) pending or loading; no ready pod "
                           f"to measure yet, holding {current}{note}", memory)
    if current > 0 and not load.available and load.ready_pods == 0 and stuck:
        # More pods of the same spec would most likely get stuck the same way: hold, and say why.
        return _clamp_hold(current, lo, hi, PODS_STUCK, f"no pod is ready or loading, holding {current}{note}",
                           memory)
    if current > 0 and not load.available:
        why = (f"no fresh metrics from {load.ready_pods} ready pod(s) (max age {a.metrics_max_age_seconds:g}s); "
               f"holding {current}")
        if load.unavailable:
            why += ": " + load.unavailable_note()
        return _clamp_hold(current, lo, hi, METRICS_UNAVAILABLE, why + note, memory)
    ratio = usage_ratio(load, a) if load.available else 0.0
    if load.available and abs(ratio - 1.0) <= a.tolerance:
        raw = current
    else:
        raw = math.ceil(load.fresh_pods * ratio - 1e-9) if load.available else lo
    recommendation = max(lo, min(hi, raw))
    # No history yet (a new service, or autoscaling just turned on): the current size counts as a
    # recommendation made now, as the Kubernetes HPA seeds it, so the first decision cannot undercut
    # spec.replicas before a whole scale-down window has been observed. (Found by e2e: a service
    # created with 2 replicas lost one on its first tick.)
    recs = memory.recommendations or ((now, current),)
    if recs[-1][1] != recommendation:
        recs = recs + ((now, recommendation),)
    window = max(a.scale_up_stabilization_seconds, a.scale_down_stabilization_seconds)
    recs = _in_window(recs, now, window)[-MAX_RECOMMENDATIONS:]
    up = min(r for _, r in _in_window(recs, now, a.scale_up_stabilization_seconds))
    down = max(r for _, r in _in_window(recs, now, a.scale_down_stabilization_seconds))
    new = current
    if new < up:
        new = up
    if new > down:
        new = down
    new = min(new, max(math.ceil(current * a.max_scale_up_factor), current + 1))
    new = max(lo, min(hi, new))
    memory = replace(memory, recommendations=recs)
    detail = (f"kv {load.kv_usage:.2f}/{a.target_kv_usage:g}, queue p90 "
              f"{'n/a' if load.queue_time_p90 is None else f'{load.queue_time_p90:.2f}s'}"
              f"/{a.target_queue_time_seconds:g}s over {load.fresh_pods} pod(s), ratio {ratio:.2f}")
    if load.unavailable:
        detail += "; " + load.unavailable_note()
    detail += note
    if new > current and not_ready > 0:
        return current, PODS_PENDING, f"{not_ready} pod(s) pending or loading; not scaling past {current} ({detail})", memory
    if new > current:
        return new, SCALED_UP, f"{current} -> {new}: {detail}", memory
    if load.unavailable:  # a pod's load is unknown: hold rather than scale down or claim all is well
        return current, METRICS_UNAVAILABLE, f"holding {current}: {detail}", memory
    if new < current:
        return new, SCALED_DOWN, f"{current} -> {new}: {detail}", memory
    if raw > hi and current >= hi:
        return current, AT_MAX, f"wants {raw} but maxReplicas is {hi}: {detail}", memory
    if raw < current and current > lo:
        return current, STABILIZING, (f"wants {recommendation}; holding {current} for the "
                                      f"{a.scale_down_stabilization_seconds:g}s scale-down window: {detail}"), memory
    if raw < lo and current == lo:
        return current, AT_MIN, f"at minReplicas {lo}: {detail}", memory
    return current, STABLE, f"holding {current}: {detail}", memory


def _in_window(recs: tuple[tuple[float, int], ...], now: float, window: float) -> tuple[tuple[float, int], ...]:
    """Recommendations in effect during [now - window, now]. Memory keeps only change points (a value
    holds until the next entry), so the entry in effect at the window's start counts too; steady
    load then writes nothing new to status."""
    start = now - window
    first = 0
    for i, (t, _) in enumerate(recs):
        if t <= start:
            first = i
    return recs[first:]


def _clamp_hold(current: int, lo: int, hi: int, reason: str, message: str, memory: Memory) -> tuple[int, str, str, Memory]:
    return max(lo, min(hi, current)), reason, message, memory


def _shed(spec: ModelServiceSpec, at_capacity: bool, load: Load, memory: Memory,
          now: float) -> tuple[tuple[str, ...], str, str, Memory]:
    s: LoadShedding = spec.load_shedding
    order = shed_order(spec)
    shed = tuple(c for c in memory.shed_classes if c in order)  # classes removed from the spec un-shed
    if not s.enabled:
        return (), (SHED_STOPPED if shed else SHED_DISABLED), "loadShedding.enabled is false", Memory(
            recommendations=memory.recommendations)
    if not load.available:
        msg = f"metrics unavailable; holding shed classes {list(shed)}" if shed else "metrics unavailable"
        if load.unavailable:
            msg += ": " + load.unavailable_note()
        return shed, (SHED_HOLDING if shed else NOT_SHEDDING), msg, replace(memory, shed_classes=shed)
    kv = load.kv_usage or 0.0
    q = load.queue_time_p90
    overloaded = kv >= s.kv_usage_on or (q is not None and q >= s.queue_time_on_seconds)
    calm = kv <= s.kv_usage_off and (q is None or q <= s.queue_time_off_seconds)
    detail = f"kv {kv:.2f} (on {s.kv_usage_on:g}, off {s.kv_usage_off:g}), queue p90 " + (
        "n/a" if q is None else f"{q:.2f}s") + f" (on {s.queue_time_on_seconds:g}s, off {s.queue_time_off_seconds:g}s)"
    changed_at = memory.shed_changed_at if memory.shed_changed_at is not None else -math.inf
    if overloaded and at_capacity:
        mem = replace(memory, shed_classes=shed, calm_since=None,
                      overloaded_since=memory.overloaded_since if memory.overloaded_since is not None else now)
        if not shed and order:
            new = order[:1]
            return new, SHED_STARTED, f"shedding {list(new)}: {detail}", replace(mem, shed_classes=new, shed_changed_at=now)
        if len(shed) < len(order) and now - changed_at >= s.step_seconds:
            new = order[: len(shed) + 1]
            return new, SHED_ESCALATED, f"shedding {list(new)}: {detail}", replace(mem, shed_classes=new, shed_changed_at=now)
        return shed, SHED_HOLDING, f"overloaded, shedding {list(shed)}: {detail}", mem
    if calm:
        mem = replace(memory, shed_classes=shed, overloaded_since=None,
                      calm_since=memory.calm_since if memory.calm_since is not None else now)
        if shed and now - max(mem.calm_since or now, changed_at) >= s.step_seconds:
            new = shed[:-1]
            reason = SHED_REDUCED if new else SHED_STOPPED
            return new, reason, f"calm; shedding {list(new)}: {detail}", replace(mem, shed_classes=new, shed_changed_at=now)
        if shed:
            return shed, SHED_HOLDING, f"calm, waiting {s.step_seconds:g}s before un-shedding: {detail}", mem
        return (), NOT_SHEDDING, detail, mem
    mem = replace(memory, shed_classes=shed, overloaded_since=None, calm_since=None)
    if shed:
        return shed, SHED_HOLDING, f"between thresholds, holding {list(shed)}: {detail}", mem
    why = "overloaded but the service can still grow" if overloaded else "below the shedding thresholds"
    return (), NOT_SHEDDING, f"{why}: {detail}", mem


def hold(spec: ModelServiceSpec, current: int, memory: Memory, why: str) -> Decision:
    """The decision when the tick could not evaluate any metrics at all (`why`): keep the size
    and the shed set, as missing metrics do, and say so in the Scaling condition."""
    held = max(spec.min_replicas, min(spec.max_replicas, current)) if spec.autoscaling.enabled else current
    shed = tuple(c for c in memory.shed_classes if c in shed_order(spec)) if spec.load_shedding.enabled else ()
    return Decision(replicas=held, reason=METRICS_UNAVAILABLE, message=f"holding {held}: {why}", shed_classes=shed,
                    shed_reason=SHED_HOLDING if shed else NOT_SHEDDING, shed_message=f"metrics unavailable: {why}",
                    memory=replace(memory, shed_classes=shed), load=Load(fresh_pods=0, ready_pods=0))


def decide(spec: ModelServiceSpec, current: int, pods: tuple[PodLoad, ...] | list[PodLoad], memory: Memory,
           now: float) -> Decision:
    """One tick of the policy. `current` is the replica count now targeted (the Deployment's spec)."""
    pods = tuple(pods)
    load = aggregate(pods, spec.autoscaling.metrics_max_age_seconds)
    replicas, reason, message, memory = _scale(spec, current, pods, load, memory, now)
    at_capacity = (not spec.autoscaling.enabled) or (replicas >= spec.max_replicas and reason != SCALED_UP)
    shed, shed_reason, shed_message, memory = _shed(spec, at_capacity, load, memory, now)
    # Why requests waited or failed, from the engines themselves: the reasons behind the numbers.
    if cited := load.decisions_note():
        message = f"{message}; {cited}"
        if shed:
            shed_message = f"{shed_message}; {cited}"
    costs = deletion_costs(pods, spec.autoscaling.metrics_max_age_seconds) if replicas < current else {}
    return Decision(replicas=replicas, reason=reason, message=message, shed_classes=shed, shed_reason=shed_reason,
                    shed_message=shed_message, memory=memory, load=load, deletion_costs=costs)
