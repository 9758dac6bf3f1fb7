"""The plan: a pure comparison of desired manifests with what exists, as a list of actions.

`plan()` assumes `observed` is an accurate snapshot of the children (by kind and name). It returns
the actions that make them match (apply what is missing or differs, and create the admin Secret
whenever the Deployment that mounts it is applied: the operator may create Secrets but not read
them, so it re-creates rather than observes; an existing one answers 409 and stays)
plus the facts worth an Event: a rollout to a new service version and a change of replica count.
Children are deleted here only when the spec turns an optional one off (a NetworkPolicy: `absent`)
and it is ours; otherwise ownerReferences hand deletion to the garbage collector. An
unchanged spec plans nothing, which is what makes a second reconcile a no-op.

Drift is judged the way server-side apply writes, so that every planned apply converges:
* a field we set whose value differs is drift (the forced apply takes it back);
* a field we own (our `managedFields` entry) that we no longer set is drift (the apply removes it);
* what another manager added beside our fields is not drift: an extra key in a map, or an extra
  entry in a list Kubernetes merges by key (`MAP_LIST_KEYS`: `kubectl set env` adds an entry to
  `env`, a mesh injects a container). An apply cannot remove those (they are not ours), so
  calling them drift would re-apply every tick for ever. Lists Kubernetes treats as atomic
  (args, tolerations, ...) are compared whole: a forced apply replaces them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from magnitude.operator import naming as n

ChildKey = tuple[str, str]  # (kind, name)


@dataclass(frozen=True)
class Apply:
    obj: dict[str, Any]
    reason: str  # "create" | "update"


@dataclass(frozen=True)
class Create:
    """Create if absent (409 otherwise: fine); never updated. Only the admin Secret, whose name
    changes with its token, so an existing one is always right."""

    obj: dict[str, Any]


@dataclass(frozen=True)
class Delete:
    """Remove an optional child the spec turned off (only one this owner controls)."""

    obj: dict[str, Any]


Action = Apply | Create | Delete


@dataclass(frozen=True)
class Plan:
    actions: list[Action] = field(default_factory=list)
    rollout: tuple[str, str] | None = None  # (old service version, new)
    replicas: tuple[int, int] | None = None  # (old Deployment replicas, new)

    @property
    def empty(self) -> bool:
        return not self.actions


def key(obj: dict[str, Any]) -> ChildKey:
    return obj["kind"], obj["metadata"]["name"]


# Lists that Kubernetes merges by key under server-side apply (`x-kubernetes-list-type: map` in
# the schemas of the kinds we build), by field name, with their keys. `ports` is keyed by
# containerPort in a container and by port in a Service.
MAP_LIST_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",), "initContainers": ("name",), "env": ("name",), "volumes": ("name",),
    "volumeMounts": ("mountPath",), "ownerReferences": ("uid",), "imagePullSecrets": ("name",),
    "ports": ("containerPort", "protocol"),
}
SERVICE_PORT_KEYS = ("port", "protocol")


def _list_keys(field_name: str, want: list[Any]) -> tuple[str, ...] | None:
    keys = MAP_LIST_KEYS.get(field_name)
    if keys is None or not all(isinstance(w, dict) for w in want):
        return None
    if field_name == "ports" and not all("containerPort" in w for w in want):
        return SERVICE_PORT_KEYS
    return keys


def is_subset(want: Any, have: Any, field_name: str = "") -> bool:
    """True when every field we set in `want` has the same value in `have`. The server adds
    defaults and other managers add fields and keyed list entries: none of that is drift."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and is_subset(v, have[k], k) for k, v in want.items())
    if isinstance(want, list):
        if not isinstance(have, list):
            return False
        keys = _list_keys(field_name, want)
        if keys is None:  # atomic: ours whole
            return len(want) == len(have) and all(is_subset(w, h) for w, h in zip(want, have))
        entries = {tuple(h.get(k) for k in keys): h for h in have if isinstance(h, dict)}
        return all(is_subset(w, entries.get(tuple(w.get(k) for k in keys))) for w in want)
    if isinstance(want, (int, float)) and isinstance(have, (int, float)) and not isinstance(want, bool):
        return float(want) == float(have)
    return bool(want == have)


def _owned(fields: dict[str, Any], value: Any, path: str) -> list[str]:
    """Paths of the managedFields tree `fields` (fieldsV1) that `value` no longer sets."""
    gone: list[str] = []
    for key, sub in fields.items():
        kind, _, name = key.partition(":")
        if kind == "f":
            if not isinstance(value, dict) or name not in value:
                gone.append(f"{path}.{name}")
            elif isinstance(sub, dict) and sub:
                gone += _owned(sub, value[name], f"{path}.{name}")
        elif kind == "k":  # an entry of a keyed list, named by its key values
            keyed = json.loads(name)
            match = [v for v in value if isinstance(v, dict) and all(v.get(k) == x for k, x in keyed.items())] \
                if isinstance(value, list) else []
            if not match:
                gone.append(f"{path}[{name}]")
            elif isinstance(sub, dict) and sub:
                gone += _owned(sub, match[0], f"{path}[{name}]")
        elif kind == "v":  # an entry of a set
            if not isinstance(value, list) or json.loads(name) not in value:
                gone.append(f"{path}[{name}]")
        # "." (the element itself) and "i:" (positional, not used by these kinds) say nothing more
    return gone


def no_longer_set(want: dict[str, Any], have: dict[str, Any], manager: str = n.FIELD_MANAGER) -> list[str]:
    """Fields `manager` owns through server-side apply in `have` that `want` does not set: an
    apply of `want` would remove them, so their presence is drift."""
    gone: list[str] = []
    for entry in (have.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply" and entry.get("fieldsV1"):
            gone += _owned(entry["fieldsV1"], want, "")
    return gone


def _essence(obj: dict[str, Any]) -> dict[str, Any]:
    """The parts of a manifest we own: everything but status and server-set metadata."""
    meta = obj["metadata"]
    kept = {k: meta[k] for k in ("name", "namespace", "labels", "annotations", "ownerReferences") if k in meta}
    return {**{k: v for k, v in obj.items() if k not in ("metadata", "status")}, "metadata": kept}


def _owner_uids(obj: dict[str, Any]) -> list[str]:
    return [ref.get("uid", "") for ref in obj["metadata"].get("ownerReferences") or []]


def _template_version(dep: dict[str, Any] | None) -> str | None:
    if dep is None:
        return None
    labels = (((dep.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}
    return labels.get(n.LABEL_SERVICE_VERSION)


def plan(desired: list[dict[str, Any]], observed: dict[ChildKey, dict[str, Any] | None],
         secret: dict[str, Any] | None = None, absent: list[dict[str, Any]] | None = None) -> Plan:
    """Actions turning `observed` into `desired`; `secret` (not observed) is created before any apply
    of the Deployment; each of `absent` that exists and is ours is deleted."""
    actions: list[Action] = []
    for stub in absent or []:
        have = observed.get(key(stub))
        if have is not None and set(_owner_uids(stub)) & set(_owner_uids(have)):
            actions.append(Delete(stub))
    rollout = replicas = None
    for obj in desired:
        have = observed.get(key(obj))
        if have is None:
            actions.append(Apply(obj, "create"))
        elif not is_subset(_essence(obj), have) or no_longer_set(_essence(obj), have):
            actions.append(Apply(obj, "update"))
        else:
            continue
        if obj["kind"] == "Deployment" and secret is not None:
            actions.insert(len(actions) - 1, Create(secret))  # before the pods that read it
        if obj["kind"] == "Deployment" and have is not None:
            old_v, new_v = _template_version(have), _template_version(obj)
            if old_v != new_v:
                rollout = (old_v or "", new_v or "")
            old_r, new_r = (have.get("spec") or {}).get("replicas"), obj["spec"]["replicas"]
            if old_r != new_r:
                replicas = (int(old_r or 0), int(new_r))
    return Plan(actions=actions, rollout=rollout, replicas=replicas)
