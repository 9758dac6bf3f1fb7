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
from magnitude.operator.apply import ApiError
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
    token = api.admin_token()
    assert token and len(token) >= 32


def test_second_reconcile_writes_nothing(api: Env) -> None:
    reconcile(api.kube, api.body())
    before, token, events = api.versions(), api.admin_token(), len(api.events())
    result = reconcile(api.kube, api.current())
    assert result.plan.empty and result.events == []
    assert api.versions() == before  # no child, and not the status, was written
    assert api.admin_token() == token and len(api.events()) == events


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
    ({"quantization": "w8a8", "resources": {"gpus": 1}}, "spec.quantization"),
    ({"quantization": "w8a16", "resources": {"gpus": 1}}, "spec.quantization"),
    ({"quantization": "int8", "resources": {"gpus": 1}}, "spec.quantization"),
    ({"draftModel": {"source": "pvc://Drafts/smollm2"}}, "spec.draftModel.source"),
    # A flag beats its environment variable: extraArgs would undo spec.auth without a word.
    ({"auth": {"mode": "apiKeys", "apiKeysSecretRef": {"name": "k", "key": "k"}}, "extraArgs": ["--auth-mode=none"]},
     "spec.extraArgs"),
    ({"extraArgs": ["--api-keys-file", "/tmp/keys.yaml"]}, "spec.extraArgs"),
    ({"auth": {"mode": "apiKeys", "apiKeysSecretRef": {"name": "k", "key": "k"}}, "extraArgs": ["--api-key", "s3cret"]},
     "spec.extraArgs"),
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
    reconcile(api.kube, api.body(quantization="w8a16", resources={"gpus": 1}))
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


def test_installation_defaults_reach_the_children_and_unknown_profiles_are_refused(
        api: Env, service_monitors: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from magnitude.operator import reconcile as r

    monkeypatch.setenv("MAGNITUDE_ENGINE_DEFAULTS", '{"image": "registry.example/engine:1", '
                       '"serviceMonitorLabels": {"release": "kube-prometheus-stack"}, '
                       '"profiles": {"l4": {"nodeSelector": {"gpu": "l4"}}}}')
    r.installation_defaults.cache_clear()
    try:
        reconcile(api.kube, api.body(pod={"profile": "l4"}))
        children = api.children()
        assert children["ServiceMonitor"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        pod = children["Deployment"]["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"] == "registry.example/engine:1" and pod["nodeSelector"] == {"gpu": "l4"}
        assert reconcile(api.kube, api.current()).plan.empty
        result = reconcile(api.kube, api.body(pod={"profile": "h100"}))
        degraded = next(c for c in result.status.conditions if c.type == "Degraded")
        assert degraded.status == "True" and "spec.pod.profile" in degraded.message, degraded
    finally:
        monkeypatch.delenv("MAGNITUDE_ENGINE_DEFAULTS")
        r.installation_defaults.cache_clear()


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


def test_recreated_service_gets_a_new_token_in_a_new_secret(api: Env) -> None:
    """A ModelService deleted and re-created under the same name may find the old Secret still
    there (the garbage collector is asynchronous). Its token is derived from the new uid, so it
    gets a Secret of its own: the operator never needs to read or re-own the old one."""
    reconcile(api.kube, api.body())
    old_token, old_secret = api.admin_token(), api.children()["Secret"]["metadata"]["name"]
    api.delete()  # no garbage collector runs here: the children stay, owned by a deleted uid
    reconcile(api.kube, api.body())
    assert api.admin_token() not in (None, old_token)
    env = api.get("Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    ref = next(e for e in env if e["name"] == n.ADMIN_TOKEN_ENV)["valueFrom"]["secretKeyRef"]["name"]
    assert ref != old_secret
    assert [r["uid"] for r in api.get("Secret", ref)["metadata"]["ownerReferences"]] == [api.current()["metadata"]["uid"]]
    assert api.get("Secret", old_secret) is not None  # untouched, for the garbage collector
    assert reconcile(api.kube, api.current()).plan.empty


def test_the_operator_cannot_read_or_change_any_secret(api: Env) -> None:
    """Scope, not just verbs: the chart's account can create Secrets but not get, list or patch
    one, in its own namespace or any other (a patch would answer with the Secret's data)."""
    api.core.create_namespaced_secret(api.ns, {"metadata": {"name": "db"}, "stringData": {"password": "hunter2"}})
    for call in (lambda: api.kube._call("get", "v1", "secrets", api.ns, "db"),
                 lambda: api.kube._call("list", "v1", "secrets", api.ns),
                 lambda: api.kube._call("list", "v1", "secrets", None),
                 lambda: api.kube._call("patch", "v1", "secrets", api.ns, "db", body={"metadata": {"labels": {"a": "b"}}},
                                        content_type="application/merge-patch+json")):
        with pytest.raises(ApiError) as refused:
            call()
        assert refused.value.status == 403


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


# ---- hand edits: every planned apply converges ----------------------------------------------------

def hand_patch(api: Env, patch: dict[str, Any], manager: str) -> None:
    """What `kubectl set env` / `kubectl edit` send: a strategic merge patch under their own manager."""
    from kubernetes import client as k8s

    k8s.AppsV1Api(api.server.admin).patch_namespaced_deployment(NAME, api.ns, patch, field_manager=manager)


def container(api: Env) -> dict[str, Any]:
    return api.get("Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_a_hand_edit_of_an_owned_field_is_reverted_once(api: Env) -> None:
    reconcile(api.kube, api.body())
    hand_patch(api, {"spec": {"template": {"spec": {"containers": [
        {"name": "engine", "image": "evil:latest", "env": [{"name": "MAGNITUDE_QUANTIZATION", "value": "bf16"}]}]}}}},
        "kubectl-edit")
    assert container(api)["image"] == "evil:latest"
    assert reconcile(api.kube, api.current()).plan.actions != []
    env = {e["name"]: e.get("value") for e in container(api)["env"]}
    assert container(api)["image"] != "evil:latest" and env["MAGNITUDE_QUANTIZATION"] == "none"
    before = api.versions()
    assert reconcile(api.kube, api.current()).plan.empty and api.versions() == before


def test_a_foreign_list_entry_is_left_alone_and_not_reapplied_every_tick(api: Env) -> None:
    """`kubectl set env deployment/chat INJECTED=1`: the entry is kubectl's, not ours; server-side
    apply cannot remove it, so today the plan re-applies (a no-op PATCH) on every tick for ever."""
    reconcile(api.kube, api.body())
    hand_patch(api, {"spec": {"template": {"spec": {"containers": [
        {"name": "engine", "env": [{"name": "INJECTED", "value": "1"}]}]}}}}, "kubectl-set")
    before = api.versions()
    for _ in range(3):
        assert reconcile(api.kube, api.current()).plan.empty
    assert api.versions() == before
    assert {"name": "INJECTED", "value": "1"} in container(api)["env"]  # documented: foreign additions stay


def test_a_field_the_operator_stops_setting_is_removed(api: Env) -> None:
    """GPUs 1 -> 0 changes neither the service version nor the config hash; today the GPU request,
    limit and toleration stay on the pods for ever (what remains is a superset of what is wanted)."""
    reconcile(api.kube, api.body(resources={"gpus": 1}))
    assert "nvidia.com/gpu" in container(api)["resources"]["limits"]
    reconcile(api.kube, api.body(resources={"gpus": 0}))
    pod = api.get("Deployment")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in container(api)["resources"]["limits"] and "tolerations" not in pod
    assert reconcile(api.kube, api.current()).plan.empty


def test_plan_treats_keyed_lists_as_maps_and_others_as_atomic() -> None:
    want = {"spec": {"containers": [{"name": "e", "env": [{"name": "A", "value": "1"}], "args": ["x"]}]}}
    have = copy.deepcopy(want)
    have["spec"]["containers"][0]["env"].insert(0, {"name": "INJECTED", "value": "1"})
    have["spec"]["containers"].append({"name": "sidecar"})
    assert p.is_subset(want, have)
    have["spec"]["containers"][0]["args"].append("--extra")  # args is atomic: an apply replaces it
    assert not p.is_subset(want, have)
    owned = {"f:spec": {"f:containers": {'k:{"name":"e"}': {".": {}, "f:name": {}, "f:env": {
        'k:{"name":"A"}': {".": {}, "f:name": {}, "f:value": {}}, 'k:{"name":"OLD"}': {".": {}, "f:name": {}}}}}}}
    have = {"metadata": {"managedFields": [{"manager": n.FIELD_MANAGER, "operation": "Apply", "fieldsV1": owned}]}}
    assert p.no_longer_set(want, have) == ['.spec.containers[{"name":"e"}].env[{"name":"OLD"}]']
    have["metadata"]["managedFields"][0]["manager"] = "someone-else"
    assert p.no_longer_set(want, have) == []


def test_network_policy_follows_the_spec_and_is_removed_when_turned_off(api: Env) -> None:
    reconcile(api.kube, api.body(networkPolicy={"enabled": True, "prometheusNamespaces": ["mon"]}))
    netpol = api.get("NetworkPolicy")
    assert netpol["spec"]["podSelector"]["matchLabels"] == n.selector_labels(NAME)
    peers = netpol["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {n.NAMESPACE_LABEL: "mon"}}} in peers
    assert reconcile(api.kube, api.current()).plan.empty
    result = reconcile(api.kube, api.body(networkPolicy={"enabled": False}))
    assert [type(x).__name__ for x in result.plan.actions] == ["Delete"]
    assert api.get("NetworkPolicy") is None
    assert reconcile(api.kube, api.current()).plan.empty


def test_the_operator_may_patch_only_the_deletion_cost_of_its_own_pods(api: Env) -> None:
    """RBAC grants `patch pods` cluster-wide; the chart's admission policy narrows it to the
    pod-deletion-cost annotation of the engine pods the operator manages (scope, not verbs)."""
    import time

    reconcile(api.kube, api.body())
    api.add_pod("p0", "10.0.0.1")  # from the operator's template: managed-by magnitude-operator
    api.core.create_namespaced_pod(api.ns, {"metadata": {"name": "db", "labels": {"app": "db"}},
                                            "spec": {"containers": [{"name": "db", "image": "postgres"}]}})

    def patch(pod: str, meta: dict[str, Any]) -> int:
        try:
            api.kube._call("patch", "v1", "pods", api.ns, pod, body={"metadata": meta},
                           content_type="application/merge-patch+json")
            return 200
        except ApiError as e:
            return e.status or 0
    cost = {"annotations": {n.POD_DELETION_COST: "7"}}
    deadline = time.monotonic() + 30  # the policy is enforced once the API server has loaded it
    while patch("db", cost) != 403:
        assert time.monotonic() < deadline, "the pod policy never refused a foreign pod"
        time.sleep(0.5)
    assert patch("p0", cost) == 200
    api.kube.set_deletion_costs(api.ns, {"p0": 3})
    assert api.get("Pod", "p0")["metadata"]["annotations"][n.POD_DELETION_COST] == "3"
    assert patch("p0", {"labels": {"app.kubernetes.io/name": "something-else"}}) == 403
    assert patch("p0", {"annotations": {"sidecar.istio.io/inject": "true"}}) == 403
    assert patch("db", {"annotations": {n.POD_DELETION_COST: "8"}}) == 403


# ---- spec.auth ------------------------------------------------------------------------------------

def test_api_keys_without_their_secret_are_refused_by_the_api_server(api: Env) -> None:
    for auth in ({"mode": "apiKeys"}, {"mode": "trustedGateway", "apiKeysSecretRef": {"name": "k", "key": "k"}}):
        with pytest.raises(ApiException) as refused:
            api.body(auth=auth)
        assert refused.value.status == 422 and "spec.auth.apiKeysSecretRef" in refused.value.body, refused.value.body


def test_api_keys_mount_the_secret_the_operator_never_reads_and_rotation_rolls_nothing(api: Env) -> None:
    keys = {"keys": [{"key": "sk-acme-0123456789abcdef", "tenant": "acme"}]}
    api.core.create_namespaced_secret(api.ns, {"metadata": {"name": "llm-keys"}, "stringData": {"keys.yaml": str(keys)}})
    mark = len(api.server.audit(api.ns))
    reconcile(api.kube, api.body(auth={"mode": "apiKeys", "apiKeysSecretRef": {"name": "llm-keys", "key": "keys.yaml"}}))
    pod = api.get("Deployment")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env[n.AUTH_MODE_ENV] == "apiKeys" and env[n.API_KEYS_FILE_ENV] == f"{n.API_KEYS_DIR}/{n.API_KEYS_FILE}"
    assert {"name": n.API_KEYS_VOLUME, "secret": {"secretName": "llm-keys", "defaultMode": 420, "items": [
        {"key": "keys.yaml", "path": n.API_KEYS_FILE}]}} in pod["volumes"]
    assert reconcile(api.kube, api.current()).plan.empty
    # Rotation: the Secret changes; the operator plans nothing and the pods are not rolled.
    version = api.get("Deployment")["metadata"]["resourceVersion"]
    api.core.patch_namespaced_secret("llm-keys", api.ns, {"stringData": {"keys.yaml": "keys: []"}})
    assert reconcile(api.kube, api.current()).plan.empty
    assert api.get("Deployment")["metadata"]["resourceVersion"] == version
    # The kubelet mounts the Secret; the operator's account never asked for it (it may not).
    touched = [(e["verb"], (e.get("objectRef") or {}).get("name")) for e in api.server.audit(api.ns)[mark:]
               if (e.get("objectRef") or {}).get("resource") == "secrets"]
    assert all(verb == "create" and name != "llm-keys" for verb, name in touched), touched


def test_switching_auth_modes_rolls_the_pods_and_removes_the_keys_mount(api: Env) -> None:
    reconcile(api.kube, api.body(auth={"mode": "apiKeys", "apiKeysSecretRef": {"name": "llm-keys", "key": "k"}}))
    reconcile(api.kube, api.body(auth={"mode": "trustedGateway"}))
    pod = api.get("Deployment")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env[n.AUTH_MODE_ENV] == "trustedGateway" and n.API_KEYS_FILE_ENV not in env
    assert n.API_KEYS_VOLUME not in [v["name"] for v in pod["volumes"]]
    assert n.API_KEYS_VOLUME not in [m["name"] for m in pod["containers"][0]["volumeMounts"]]
    assert reconcile(api.kube, api.current()).plan.empty
