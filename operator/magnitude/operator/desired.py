"""Desired state: pure builders from a ModelService spec to the manifests that serve it.

ConfigMap (the engine document, copied from the spec without translation), admin-token Secret,
Deployment, Service, PodDisruptionBudget and, when the cluster has the CRD, a ServiceMonitor.
Every builder is a pure function returning a plain dict ready for server-side apply; pods are
stamped with the service version and config hash so a policy change rolls them.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any

import yaml

from magnitude.operator import naming as n
from magnitude.operator.servicever import config_hash, service_version
from magnitude.operator.spec import API_VERSION, KIND, ModelServiceSpec, ModelServiceStatus

# Endpoints take a moment to drop a terminating pod; keep serving through that gap before SIGTERM.
PRESTOP_SLEEP_SECONDS = 5
STARTUP_PERIOD_SECONDS = 10
# How `magnitude serve` is told each quantization (the name also travels as MAGNITUDE_QUANTIZATION).
QUANTIZATION_ARGS: dict[str, list[str]] = {"bf16": ["--dtype", "bfloat16"], "int8": ["--quantization", "int8"]}


@dataclass(frozen=True)
class Owner:
    """The ModelService a child belongs to (for names, namespace and ownerReferences)."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> "Owner":
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


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
    server's defaulting), so a value left to the engine stays the engine's choice."""
    return spec.engine_config().model_dump(mode="json", by_alias=True, exclude_unset=True)


def desired_replicas(spec: ModelServiceSpec, status: ModelServiceStatus | None) -> int:
    """Pods to run: the autoscaler's last decision when it owns the count, else spec.replicas."""
    if spec.autoscaling.enabled:
        held = status.desired_replicas if status is not None else None
        start = held if held is not None else (spec.replicas if spec.replicas is not None else spec.min_replicas)
        return max(spec.min_replicas, min(spec.max_replicas, start))
    return spec.replicas if spec.replicas is not None else spec.min_replicas


def build_config_map(owner: Owner, spec: ModelServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(owner, n.config_map_name(owner.name)),
        "data": {n.CONFIG_FILE: yaml.safe_dump(engine_document(spec), sort_keys=False)},
    }


def build_admin_secret(owner: Owner, token: str) -> dict[str, Any]:
    """The shared token the engines accept on /admin/*; created once, never rotated by reconcile."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(owner, n.admin_secret_name(owner.name)),
        "data": {n.ADMIN_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def _env(spec: ModelServiceSpec, owner: Owner, version: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "MAGNITUDE_SERVICE_VERSION", "value": version},
        {"name": "MAGNITUDE_QUANTIZATION", "value": spec.quantization},
        {
            "name": n.ADMIN_TOKEN_ENV,
            "valueFrom": {"secretKeyRef": {"name": n.admin_secret_name(owner.name), "key": n.ADMIN_TOKEN_KEY}},
        },
    ]
    if spec.model.revision:
        env.append({"name": "MAGNITUDE_MODEL_REVISION", "value": spec.model.revision})
    if spec.draft_model is not None:
        env.append({"name": "MAGNITUDE_DRAFT_MODEL", "value": spec.draft_model.source})
        env.append({"name": "MAGNITUDE_NUM_SPECULATIVE_TOKENS", "value": str(spec.draft_model.num_speculative_tokens)})
        if spec.draft_model.revision:
            env.append({"name": "MAGNITUDE_DRAFT_MODEL_REVISION", "value": spec.draft_model.revision})
    return env


def _resources(spec: ModelServiceSpec) -> dict[str, Any]:
    r = spec.resources
    requests: dict[str, str] = {"cpu": r.cpu, "memory": r.memory}
    limits: dict[str, str] = {"memory": r.memory}
    if r.gpus:
        requests[r.gpu_resource_name] = str(r.gpus)
        limits[r.gpu_resource_name] = str(r.gpus)
    return {"requests": requests, "limits": limits}


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
        "--model", spec.model.source,
        "--config", f"{n.CONFIG_DIR}/{n.CONFIG_FILE}",
        "--host", "0.0.0.0",
        "--port", str(n.ENGINE_PORT),
        "--shutdown-grace", str(spec.drain_seconds),
        *QUANTIZATION_ARGS.get(spec.quantization, []),
        *spec.extra_args,
    ]
    container = {
        "name": "engine",
        "image": spec.image,
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
        "volumeMounts": [{"name": "engine-config", "mountPath": n.CONFIG_DIR, "readOnly": True}],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "engine-config", "configMap": {"name": n.config_map_name(owner.name)}}],
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if spec.resources.gpus:
        pod_spec["tolerations"] = [
            {"key": spec.resources.gpu_resource_name, "operator": "Exists", "effect": "NoSchedule"}
        ]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, n.deployment_name(owner.name)),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": n.selector_labels(owner.name)},
            # Surge, never dip: a rollout adds a pod before it removes one, so capacity holds.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
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
            },
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
        },
    }


def build_all(owner: Owner, spec: ModelServiceSpec, replicas: int, service_monitor: bool) -> list[dict[str, Any]]:
    """Every applied child in apply order (config before the pods that mount it). The Secret is separate:
    it is created once with a fresh token (see `build_admin_secret`)."""
    objs = [build_config_map(owner, spec), build_deployment(owner, spec, replicas), build_service(owner),
            build_pdb(owner)]
    if service_monitor:
        objs.append(build_service_monitor(owner))
    return objs
