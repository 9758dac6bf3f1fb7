"""Desired state: pure builders from a ModelService spec to the manifests that serve it.

ConfigMap (the engine document, copied from the spec without translation), admin-token Secret,
Deployment, Service, PodDisruptionBudget, when the cluster has the CRD a ServiceMonitor, and when
`spec.networkPolicy.enabled` a NetworkPolicy. Engine pods run without a service-account token and
with a read-only root filesystem: the model cache, HF_HOME and the temp dir are emptyDirs.
Every builder is a pure function returning a plain dict ready for server-side apply; pods are
stamped with the service version and config hash so a policy change rolls them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
from dataclasses import dataclass
from typing import Any

import yaml

from magnitude.operator import naming as n
from magnitude.operator import modelsource, podshape
from magnitude.operator.servicever import config_hash, service_version
from magnitude.operator.spec import API_VERSION, DEFAULT_ENGINE_IMAGE, KIND, ModelServiceSpec, ModelServiceStatus

# Endpoints take a moment to drop a terminating pod; keep serving through that gap before SIGTERM.
PRESTOP_SLEEP_SECONDS = 5
STARTUP_PERIOD_SECONDS = 10
# Where the engine (and the libraries under it) write, all inside the writable volumes: the
# converted-model cache, Hugging Face downloads, any other library cache, and temp files.
WRITABLE_ENV: dict[str, str] = {
    "MAGNITUDE_CACHE": n.CACHE_DIR,  # the engine keeps models/ and quantization-records/ under it
    "HF_HOME": f"{n.CACHE_DIR}/huggingface",
    "XDG_CACHE_HOME": f"{n.CACHE_DIR}/xdg",
    "TMPDIR": n.TMP_DIR,
}
WRITABLE_VOLUMES: dict[str, str] = {"cache": n.CACHE_DIR, "tmp": n.TMP_DIR}  # emptyDir name -> mount path
# Where the operator runs when it cannot tell (the chart's default namespace).
DEFAULT_OPERATOR_NAMESPACE = "magnitude-system"


def admin_token(key: bytes, namespace: str, name: str, uid: str) -> str:
    """The engines' admin token for one ModelService: HMAC-SHA256 of its identity under the
    operator's key. The operator derives it whenever it calls an engine, so it never reads a
    Secret back; a re-created ModelService (new uid) or a new key gives a new token."""
    digest = hmac.new(key, f"{namespace}/{name}/{uid}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


@dataclass(frozen=True)
class Owner:
    """The ModelService a child belongs to (for names, namespace and ownerReferences), and the
    admin token its engines accept (see `admin_token`)."""

    name: str
    namespace: str
    uid: str
    token: str = ""

    @classmethod
    def from_body(cls, body: dict[str, Any], key: bytes = b"") -> "Owner":
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"],
                   token=admin_token(key, meta["namespace"], meta["name"], meta["uid"]))

    @property
    def admin_secret(self) -> str:
        """The Secret holding `token`, named after the token's fingerprint: a new token gets a new
        Secret (created, never patched), so the operator needs no right to read or change one."""
        return n.admin_secret_name(self.name, hashlib.sha256(self.token.encode()).hexdigest()[:10])


def owner_reference(owner: Owner) -> dict[str, Any]:
    # blockOwnerDeletion is left unset: it would need `update` on modelservices/finalizers.
    return {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name, "uid": owner.uid, "controller": True}


def _metadata(owner: Owner, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": n.common_labels(owner.name),
        "ownerReferences": [owner_reference(owner)],
    }


def engine_document(spec: ModelServiceSpec) -> dict[str, Any]:
    """The engine's config file content (DESIGN §3 Config): the fields as written (after the API
    server's defaulting), so a value left to the engine stays the engine's choice. One translation:
    a pvc:// draft source becomes the path its claim is mounted at (modelsource.py)."""
    doc = spec.engine_config().model_dump(mode="json", by_alias=True, exclude_unset=True)
    draft = doc.get("draftModel")
    if draft and draft.get("source"):
        draft["source"] = modelsource.engine_path(draft["source"])
    return doc


def desired_replicas(spec: ModelServiceSpec, status: ModelServiceStatus | None) -> int:
    """Pods to run: the autoscaler's last decision when it owns the count, else spec.replicas."""
    if spec.autoscaling.enabled:
        held = status.desired_replicas if status is not None else None
        start = held if held is not None else spec.replicas
        return max(spec.min_replicas, min(spec.max_replicas, start))
    return spec.replicas


def build_config_map(owner: Owner, spec: ModelServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(owner, n.config_map_name(owner.name)),
        "data": {n.CONFIG_FILE: yaml.safe_dump(engine_document(spec), sort_keys=False)},
    }


def build_admin_secret(owner: Owner) -> dict[str, Any]:
    """The token the engines accept on /admin/* and /debug/* (people read it from here)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(owner, owner.admin_secret),
        "data": {n.ADMIN_TOKEN_KEY: base64.b64encode(owner.token.encode()).decode()},
    }


def _env(spec: ModelServiceSpec, owner: Owner, version: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "MAGNITUDE_SERVICE_VERSION", "value": version},
        {"name": "MAGNITUDE_QUANTIZATION", "value": spec.quantization},
        {
            "name": n.ADMIN_TOKEN_ENV,
            "valueFrom": {"secretKeyRef": {"name": owner.admin_secret, "key": n.ADMIN_TOKEN_KEY}},
        },
    ]
    env += [{"name": k, "value": v} for k, v in WRITABLE_ENV.items()]
    env.append({"name": n.AUTH_MODE_ENV, "value": spec.auth.mode})
    if spec.auth.api_keys_secret_ref is not None:
        env.append({"name": n.API_KEYS_FILE_ENV, "value": f"{n.API_KEYS_DIR}/{n.API_KEYS_FILE}"})
    if spec.model.revision:
        env.append({"name": "MAGNITUDE_MODEL_REVISION", "value": spec.model.revision})
    env += modelsource.env(spec)
    return env


def _auth_volumes(spec: ModelServiceSpec) -> list[dict[str, Any]]:
    """The keys Secret of `auth.mode: apiKeys`, only its one key, under a fixed file name. The pod
    template names the Secret, never its content, so editing the Secret rolls nothing: the kubelet
    updates the mounted file and the engine re-reads it."""
    ref = spec.auth.api_keys_secret_ref
    if ref is None:
        return []
    return [{"name": n.API_KEYS_VOLUME, "secret": {
        "secretName": ref.name, "items": [{"key": ref.key, "path": n.API_KEYS_FILE}]}}]


def _auth_mounts(spec: ModelServiceSpec) -> list[dict[str, Any]]:
    # The whole folder, never subPath: the kubelet never updates a subPath mount, so rotation would need a restart.
    return [{"name": n.API_KEYS_VOLUME, "mountPath": n.API_KEYS_DIR, "readOnly": True}] if _auth_volumes(spec) else []


def _resources(spec: ModelServiceSpec) -> dict[str, Any]:
    r = spec.resources
    requests: dict[str, str] = {"cpu": r.cpu, "memory": r.memory}
    limits: dict[str, str] = {"memory": r.memory}
    if r.gpus:
        requests[r.gpu_resource_name] = str(r.gpus)
        limits[r.gpu_resource_name] = str(r.gpus)
    return {"requests": requests, "limits": limits}


def weight_args(spec: ModelServiceSpec) -> list[str]:
    """How `magnitude serve` is told the weights: the method as named in the spec (the engine knows
    `int8` as w8a8's alias), and the dtype only when set, so `auto` stays the engine's choice
    (float32 on CPU, bfloat16 on GPU). The method also travels as MAGNITUDE_QUANTIZATION."""
    args = ["--quantization", spec.quantization] if spec.quantization != "none" else []
    return args + (["--dtype", spec.dtype] if spec.dtype != "auto" else [])


def _probe(path: str, period: int, failures: int, timeout: int = 3) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": n.ENGINE_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def termination_grace_seconds(spec: ModelServiceSpec) -> int:
    """preStop pause + the engine's drain budget + a margin for the process to exit."""
    return PRESTOP_SLEEP_SECONDS + spec.drain_seconds + 5


def build_deployment(owner: Owner, spec: ModelServiceSpec, replicas: int) -> dict[str, Any]:
    version = service_version(spec)
    args = [
        "serve",
        "--model", modelsource.model_arg(spec),
        "--config", f"{n.CONFIG_DIR}/{n.CONFIG_FILE}",
        "--host", "0.0.0.0",
        "--port", str(n.ENGINE_PORT),
        "--shutdown-grace", str(spec.drain_seconds),
        *weight_args(spec),
        *modelsource.serve_args(spec),
        *(["--metrics-compat", spec.metrics.compat] if spec.metrics.compat != "none" else []),
        *spec.extra_args,
    ]
    container = {
        "name": "engine",
        "image": spec.image or DEFAULT_ENGINE_IMAGE,  # reconcile folds the installation's default in first
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["magnitude"],
        "args": args,
        "ports": [{"name": n.ENGINE_PORT_NAME, "containerPort": n.ENGINE_PORT, "protocol": "TCP"}],
        "env": _env(spec, owner, version),
        "resources": _resources(spec),
        # Startup gates the other probes until the model is loaded; its budget is the load timeout.
        "startupProbe": _probe("/readyz", STARTUP_PERIOD_SECONDS,
                               max(1, math.ceil(spec.model_load_timeout_seconds / STARTUP_PERIOD_SECONDS))),
        "readinessProbe": _probe("/readyz", 5, 3),
        "livenessProbe": _probe("/healthz", 10, 6, timeout=5),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        "volumeMounts": [{"name": "engine-config", "mountPath": n.CONFIG_DIR, "readOnly": True}]
        + [{"name": name, "mountPath": path} for name, path in WRITABLE_VOLUMES.items()] + _auth_mounts(spec)
        + modelsource.mounts(spec),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "readOnlyRootFilesystem": True},
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "engine-config", "configMap": {"name": n.config_map_name(owner.name)}}]
        + [{"name": name, **(modelsource.cache_volume_source(spec) if name == modelsource.CACHE_VOLUME
                             else {"emptyDir": {}})} for name in WRITABLE_VOLUMES]
        + _auth_volumes(spec) + modelsource.volumes(spec),
        # The engine never calls the Kubernetes API: a token in the pod is only something to steal.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if spec.resources.gpus:
        pod_spec["tolerations"] = [
            {"key": spec.resources.gpu_resource_name, "operator": "Exists", "effect": "NoSchedule"}
        ]
    template = {
        "metadata": {
            "labels": {**n.common_labels(owner.name), n.LABEL_SERVICE_VERSION: version},
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(n.ENGINE_PORT),
                "prometheus.io/path": "/metrics",
                n.ANNOTATION_SERVICE_VERSION: version,
                n.ANNOTATION_CONFIG_HASH: config_hash(engine_document(spec)),
            },
        },
        "spec": pod_spec,
    }
    podshape.apply(spec, template)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, n.deployment_name(owner.name)),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": n.selector_labels(owner.name)},
            # Surge, never dip: a rollout adds a pod before it removes one, so capacity holds.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": template,
        },
    }


def build_service(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, n.service_name(owner.name)),
        "spec": {
            "type": "ClusterIP",
            "selector": n.selector_labels(owner.name),
            "ports": [{"name": n.ENGINE_PORT_NAME, "port": n.ENGINE_PORT, "targetPort": n.ENGINE_PORT_NAME,
                       "protocol": "TCP"}],
        },
    }


def build_pdb(owner: Owner) -> dict[str, Any]:
    # maxUnavailable (not minAvailable) so a single-replica service never blocks a node drain.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, n.pdb_name(owner.name)),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": n.selector_labels(owner.name)}},
    }


def build_service_monitor(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _metadata(owner, n.service_monitor_name(owner.name)),
        "spec": {
            "selector": {"matchLabels": n.selector_labels(owner.name)},
            "endpoints": [{"port": n.ENGINE_PORT_NAME, "path": "/metrics", "interval": "15s"}],
            # The label annotation-based scraping gets from the pod (labelmap): the chart's dashboard
            # selects ModelServices by it under either way of scraping.
            "podTargetLabels": [n.LABEL_NAME],
        },
    }


def _namespaces(names: list[str]) -> list[dict[str, Any]]:
    return [{"namespaceSelector": {"matchLabels": {n.NAMESPACE_LABEL: ns}}} for ns in names]


def build_network_policy(owner: Owner, spec: ModelServiceSpec, operator_namespace: str) -> dict[str, Any]:
    """Ingress to the engine port only from: the operator's namespace (scrapes, /admin/shedding),
    the Prometheus namespaces, and clients (the ModelService's own namespace and
    `clientNamespaces`, narrowed to `clientPodLabels` when set). Egress is left alone: pods
    may need to download weights."""
    np = spec.network_policy
    # {} selects every pod; the API server drops an empty matchLabels, so it is not written.
    pods: dict[str, Any] = {"matchLabels": dict(np.client_pod_labels)} if np.client_pod_labels else {}
    clients = [{"podSelector": pods}] + [
        {**peer, "podSelector": pods} for peer in _namespaces(sorted(set(np.client_namespaces) - {owner.namespace}))]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(owner, n.network_policy_name(owner.name)),
        "spec": {
            "podSelector": {"matchLabels": n.selector_labels(owner.name)},
            "policyTypes": ["Ingress"],
            "ingress": [{
                "ports": [{"port": n.ENGINE_PORT, "protocol": "TCP"}],
                "from": _namespaces(sorted({operator_namespace, *np.prometheus_namespaces})) + clients,
            }],
        },
    }


def build_all(owner: Owner, spec: ModelServiceSpec, replicas: int, service_monitor: bool,
              operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE) -> list[dict[str, Any]]:
    """Every applied child in apply order (config before the pods that mount it). The Secret is separate:
    it is only ever created (see `Owner.admin_secret`)."""
    objs = [build_config_map(owner, spec), build_deployment(owner, spec, replicas), build_service(owner),
            build_pdb(owner)]
    if service_monitor:
        objs.append(build_service_monitor(owner))
    if spec.network_policy.enabled:
        objs.append(build_network_policy(owner, spec, operator_namespace))
    return objs


def absent_children(owner: Owner, spec: ModelServiceSpec) -> list[dict[str, Any]]:
    """Optional children the spec no longer asks for, as (apiVersion, kind, metadata) stubs: the
    plan deletes them when they exist and are ours (turning a NetworkPolicy off must open the pods
    again, and the garbage collector only acts when the ModelService goes)."""
    if spec.network_policy.enabled:
        return []
    return [{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
             "metadata": _metadata(owner, n.network_policy_name(owner.name))}]
