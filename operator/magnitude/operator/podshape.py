"""spec.pod onto the engine pod template: the placement and identity fields a platform sets
(node selector, tolerations, affinity, topology spread, pull secrets, ServiceAccount, priority
and runtime class, labels, annotations, env, envFrom, extra volumes and mounts) and /dev/shm.

Pure: it adds spec.pod's entries to the template `desired.build_deployment` built. The spec's
validators have already refused every entry that would replace one of the operator's (reserved
env names, volume names, mount paths, label and annotation prefixes), so nothing here
overwrites; the two security contexts are the one exception, and only key by key, from fields
that say so (`spec.pod.securityContext`, `spec.pod.containerSecurityContext`).
"""

from __future__ import annotations

from typing import Any

from magnitude.operator.spec import ModelServiceSpec

SHM_VOLUME = "dshm"
SHM_PATH = "/dev/shm"
# NCCL, PyTorch's DataLoader workers and CUDA IPC use /dev/shm; a container runtime's default is 64 MiB.
GPU_SHM_SIZE = "1Gi"


def shm_size(spec: ModelServiceSpec) -> str | None:
    """The memory-backed /dev/shm size: explicit, else 1Gi on GPU pods, else none (CPU pods)."""
    if spec.pod.shm_size is not None:
        return spec.pod.shm_size
    return GPU_SHM_SIZE if spec.resources.gpus > 0 else None


def apply(spec: ModelServiceSpec, template: dict[str, Any]) -> None:
    """Add spec.pod to a pod template (`{metadata, spec}`) whose first container is the engine."""
    shape = spec.pod
    meta, pod = template["metadata"], template["spec"]
    container = pod["containers"][0]
    meta["labels"] = {**shape.labels, **meta.get("labels", {})}
    if shape.annotations:
        meta["annotations"] = {**shape.annotations, **meta.get("annotations", {})}
    if shape.node_selector:
        pod["nodeSelector"] = dict(shape.node_selector)
    tolerations = pod.get("tolerations", []) + [t.model_dump(mode="json", by_alias=True, exclude_none=True)
                                                for t in shape.tolerations]
    if tolerations:
        pod["tolerations"] = [t for i, t in enumerate(tolerations) if t not in tolerations[:i]]
    if shape.affinity:
        pod["affinity"] = shape.affinity
    if shape.topology_spread_constraints:
        pod["topologySpreadConstraints"] = list(shape.topology_spread_constraints)
    if shape.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s.name} for s in shape.image_pull_secrets]
    for key, value in (("serviceAccountName", shape.service_account_name),
                       ("priorityClassName", shape.priority_class_name),
                       ("runtimeClassName", shape.runtime_class_name)):
        if value is not None:
            pod[key] = value
    pod["automountServiceAccountToken"] = shape.automount_service_account_token
    container["env"] = container.get("env", []) + [e.model_dump(mode="json", by_alias=True, exclude_none=True)
                                                   for e in shape.env]
    if shape.env_from:
        container["envFrom"] = list(shape.env_from)
    pod["volumes"] = pod.get("volumes", []) + list(shape.volumes)
    container["volumeMounts"] = container.get("volumeMounts", []) + [
        m.model_dump(mode="json", by_alias=True, exclude_none=True) for m in shape.volume_mounts]
    size = shm_size(spec)
    if size is not None:
        pod["volumes"].append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": size}})
        container["volumeMounts"].append({"name": SHM_VOLUME, "mountPath": SHM_PATH})
    if shape.security_context:
        pod["securityContext"] = {**pod.get("securityContext", {}), **shape.security_context}
    if shape.container_security_context:
        container["securityContext"] = {**container.get("securityContext", {}), **shape.container_security_context}
