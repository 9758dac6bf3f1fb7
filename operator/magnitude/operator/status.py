"""Status: pure functions from what was observed to `status` and its conditions.

Conditions follow metav1.Condition: `lastTransitionTime` moves only when `status` flips, and each
carries the generation it describes. `Ready`, `Progressing` and `Degraded` come from the Deployment
and the spec checks; `Scaling` and `Shedding` from the autoscaler's last decision, and
`QuantizationValidated` (with `Degraded` when a pod rejected its quantized weights) from the pods'
/readyz reports (`quantization.judge`); both kept from the previous status by reconciles that did
not look at the pods (the change handlers). The caller writes status only when `changed()` says so.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from magnitude.operator import autoscaler as a
from magnitude.operator import quantization as q
from magnitude.operator.spec import (AutoscalerMemory, Condition, LoadSnapshot, ModelServiceStatus, ModelStatus,
                                     Recommendation, SchedulerStatus)
from magnitude.operator.validation import Problem

READY, PROGRESSING, DEGRADED, SCALING, SHEDDING = "Ready", "Progressing", "Degraded", "Scaling", "Shedding"
QUANTIZATION_VALIDATED = "QuantizationValidated"
CONDITION_ORDER = (READY, PROGRESSING, DEGRADED, SCALING, SHEDDING, QUANTIZATION_VALIDATED)
QUANTIZATION_REJECTED = "QuantizationRejected"  # Degraded's reason when a pod refused its weights
SCALING_ACTIVE = frozenset({a.SCALED_UP, a.SCALED_DOWN, a.PODS_PENDING})


@dataclass(frozen=True)
class Observed:
    """What the reconcile saw of the Deployment (None: it does not exist)."""

    deployment: dict[str, Any] | None
    desired_replicas: int
    service_version: str
    selector: str
    problems: tuple[Problem, ...] = ()
    apply_error: str | None = None
    invalid_spec: str | None = None  # the spec did not parse
    quantized: bool = False  # spec.quantization is not none: QuantizationValidated applies
    pod_reports: tuple[q.PodReport, ...] | None = None  # the pods' /readyz; None: not looked at this time


def _set(conds: dict[str, Condition], type_: str, status: str, reason: str, message: str, generation: int | None,
         now: str) -> None:
    prev = conds.get(type_)
    since = prev.last_transition_time if prev is not None and prev.status == status else now
    conds[type_] = Condition(type=type_, status=status, reason=reason, message=message[:4000],
                             last_transition_time=since, observed_generation=generation)


def _deployment_numbers(dep: dict[str, Any] | None) -> tuple[int, int, int, bool, str | None]:
    """(pods, ready, updated, rollout done, failure message)."""
    if dep is None:
        return 0, 0, 0, False, None
    st = dep.get("status") or {}
    want = (dep.get("spec") or {}).get("replicas", 1)
    pods, ready, updated = st.get("replicas", 0), st.get("readyReplicas", 0), st.get("updatedReplicas", 0)
    seen = st.get("observedGeneration", 0) >= (dep.get("metadata") or {}).get("generation", 0)
    done = seen and updated >= want and pods <= want and st.get("availableReplicas", 0) >= want
    failure = None
    for c in st.get("conditions") or []:
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
            failure = c.get("message") or "progress deadline exceeded"
    return pods, ready, updated, done, failure


def memory_from_status(status: ModelServiceStatus | None) -> a.Memory:
    m = status.autoscaler if status is not None else None
    if m is None:
        return a.Memory()
    return a.Memory(recommendations=tuple((r.time, r.replicas) for r in m.recommendations),
                    shed_classes=tuple(m.shed_classes), shed_changed_at=m.shed_changed_at,
                    overloaded_since=m.overloaded_since, calm_since=m.calm_since)


def _memory_to_status(m: a.Memory) -> AutoscalerMemory:
    return AutoscalerMemory(recommendations=[Recommendation(time=round(t, 3), replicas=r) for t, r in m.recommendations],
                            shed_classes=list(m.shed_classes), shed_changed_at=m.shed_changed_at,
                            overloaded_since=m.overloaded_since, calm_since=m.calm_since)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def load_snapshot(load: a.Load) -> LoadSnapshot:
    return LoadSnapshot(kv_usage=_r(load.kv_usage), waiting=_r(load.waiting), running=_r(load.running),
                        queue_time_p90_seconds=_r(load.queue_time_p90), pods_scraped=load.fresh_pods)


def build(prev: ModelServiceStatus | None, generation: int | None, obs: Observed, decision: a.Decision | None,
          now: str) -> ModelServiceStatus:
    """The new status. Parts this call knows nothing about (no `decision`) are kept from `prev`."""
    prev = prev or ModelServiceStatus()
    conds = {c.type: c for c in prev.conditions}
    pods, ready, updated, done, failure = _deployment_numbers(obs.deployment)

    if obs.deployment is None:
        why = "spec refused, nothing deployed" if obs.problems or obs.invalid_spec else "Deployment not created yet"
        _set(conds, READY, "False", "NotDeployed", why, generation, now)
    elif obs.desired_replicas == 0:
        _set(conds, READY, "False", "ScaledToZero", "replicas is 0", generation, now)
    elif ready > 0:
        _set(conds, READY, "True", "PodsReady", f"{ready}/{obs.desired_replicas} pods ready"
             + loading_note(obs.pod_reports), generation, now)
    else:
        _set(conds, READY, "False", "NoReadyPods", f"0/{obs.desired_replicas} pods ready (pending or loading)"
             + loading_note(obs.pod_reports), generation, now)

    if obs.deployment is not None and not done:
        _set(conds, PROGRESSING, "True", "RollingOut",
             f"serviceVersion {obs.service_version}: {updated}/{obs.desired_replicas} updated, {ready} ready, {pods} pods",
             generation, now)
    elif obs.deployment is not None:
        _set(conds, PROGRESSING, "False", "RolloutComplete",
             f"serviceVersion {obs.service_version} on all {updated} pods", generation, now)
    else:
        _set(conds, PROGRESSING, "False", "NotDeployed", "nothing to roll out", generation, now)

    rejected = _quantization(conds, obs, generation, now)
    if obs.invalid_spec:
        _set(conds, DEGRADED, "True", "InvalidSpec", obs.invalid_spec, generation, now)
    elif obs.problems:
        _set(conds, DEGRADED, "True", "UnsupportedSpec", "; ".join(str(p) for p in obs.problems), generation, now)
    elif obs.apply_error:
        _set(conds, DEGRADED, "True", "ApplyFailed", obs.apply_error, generation, now)
    elif rejected:  # before the progress deadline: a rejected pod is why a rollout cannot finish
        _set(conds, DEGRADED, "True", QUANTIZATION_REJECTED, rejected, generation, now)
    elif failure:
        _set(conds, DEGRADED, "True", "ProgressDeadlineExceeded", failure, generation, now)
    else:
        _set(conds, DEGRADED, "False", "AsExpected", "spec is servable and applied", generation, now)

    load, memory = prev.load, prev.autoscaler
    model = served_model(obs.pod_reports, prev.model)
    scheduler = served_scheduler(obs.pod_reports, prev.scheduler)
    if decision is not None:
        _set(conds, SCALING, "True" if decision.reason in SCALING_ACTIVE else "False", decision.reason,
             decision.message, generation, now)
        _set(conds, SHEDDING, "True" if decision.shedding else "False", decision.shed_reason, decision.shed_message,
             generation, now)
        load, memory = load_snapshot(decision.load), _memory_to_status(decision.memory)
    else:
        for type_ in (SCALING, SHEDDING):
            if type_ not in conds:
                _set(conds, type_, "Unknown", "AwaitingMetrics", "no scrape yet", generation, now)
    return ModelServiceStatus(
        observed_generation=generation,
        replicas=pods,
        ready_replicas=ready,
        desired_replicas=obs.desired_replicas,
        selector=obs.selector,
        service_version=obs.service_version,
        load=load,
        model=model,
        scheduler=scheduler,
        autoscaler=memory,
        conditions=[conds[t] for t in CONDITION_ORDER if t in conds],
    )


def loading_note(reports: tuple[q.PodReport, ...] | None) -> str:
    """`; pod p1 downloading 12.0/50.0 MB; pod p2 loading_weights`: what the not-ready pods that
    answered /readyz are doing ("" when none said)."""
    notes = []
    for r in reports or ():
        if r.phase is None:
            continue
        if r.phase == "downloading" and r.bytes_done is not None and r.bytes_total:
            notes.append(f"pod {r.pod} downloading {r.bytes_done / 1e6:.1f}/{r.bytes_total / 1e6:.1f} MB")
        else:
            notes.append(f"pod {r.pod} {r.phase}")
    return "; " + "; ".join(notes) if notes else ""


def served_model(reports: tuple[q.PodReport, ...] | None, prev: ModelStatus | None) -> ModelStatus | None:
    """What the ready pods say they serve (source, and the commit SHA of an hf:// source); during a
    rollout pods may differ, and the most common answer wins. Kept when no pod said anything."""
    said = [(r.source, r.revision or "") for r in reports or () if r.source]
    if not said:
        return prev
    (source, revision), _ = Counter(said).most_common(1)[0]
    return ModelStatus(source=source, revision=revision)


def served_scheduler(reports: tuple[q.PodReport, ...] | None, prev: SchedulerStatus | None) -> SchedulerStatus | None:
    """What the ready pods' schedulers run with (derived on each pod from its measured cost model, or
    set); pods may differ (hardware, a rollout), and the most common answer wins. Kept when none said."""
    said = [r.scheduler for r in reports or () if r.scheduler is not None]
    if not said:
        return prev
    (budget, chunk, target, source), _ = Counter(said).most_common(1)[0]
    return SchedulerStatus(token_budget=budget, prefill_chunk_size=chunk, itl_target_ms=target, source=source)


def _quantization(conds: dict[str, Condition], obs: Observed, generation: int | None, now: str) -> str | None:
    """Set (or drop) QuantizationValidated; return what Degraded must say about it (None: nothing).
    Without news the previous verdict stands, Degraded's part included: a reconcile that did not
    read the pods (a change handler), or a tick in which no pod answered with a record while the
    spec is unchanged (a pod briefly unreachable must not flap the condition and its Events)."""
    if not obs.quantized:
        conds.pop(QUANTIZATION_VALIDATED, None)
        return None
    prev, degraded = conds.get(QUANTIZATION_VALIDATED), conds.get(DEGRADED)
    verdict = q.judge(obs.pod_reports) if obs.pod_reports is not None else None
    no_news = verdict is None or (verdict.reason == q.PENDING and prev is not None and prev.reason != q.PENDING
                                  and prev.observed_generation == generation)
    if not no_news:
        assert verdict is not None
        _set(conds, QUANTIZATION_VALIDATED, verdict.status, verdict.reason, verdict.message, generation, now)
        return verdict.degraded
    if prev is None:
        _set(conds, QUANTIZATION_VALIDATED, "Unknown", q.PENDING, "no pod has been asked yet", generation, now)
    elif prev.reason == q.REJECTED and degraded is not None and degraded.reason == QUANTIZATION_REJECTED:
        return degraded.message
    return None


def changed(prev: ModelServiceStatus | None, new: ModelServiceStatus) -> bool:
    return prev is None or prev.to_document() != new.to_document()


def transitions(prev: ModelServiceStatus | None, new: ModelServiceStatus) -> list[Condition]:
    """Conditions whose (status, reason) changed: what deserves an Event."""
    old = {c.type: (c.status, c.reason) for c in (prev.conditions if prev else [])}
    return [c for c in new.conditions if old.get(c.type) != (c.status, c.reason)]
