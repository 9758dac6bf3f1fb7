"""The plan: a pure comparison of desired manifests with what exists, as a list of actions.

`plan()` assumes `observed` is an accurate snapshot of the children (by kind and name). It returns
the actions that make them match (create the admin Secret once, apply what is missing or differs)
plus the facts worth an Event: a rollout to a new service version and a change of replica count.
Children are never deleted here: ownerReferences hand that to the garbage collector. An
unchanged spec plans nothing, which is what makes a second reconcile a no-op.
"""

from __future__ import annotations

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
    """Create only if absent; never updated afterwards (the admin token must not rotate on reconcile)."""

    obj: dict[str, Any]


@dataclass(frozen=True)
class Adopt:
    """Point an existing child's ownerReferences at this owner and change nothing else. A merge patch
    replaces the list whole, which server-side apply cannot do for references another manager wrote;
    a Secret left by a deleted ModelService of the same name so keeps the token its engines hold."""

    obj: dict[str, Any]


Action = Apply | Create | Adopt


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


def is_subset(want: Any, have: Any) -> bool:
    """True when every field we set in `want` has the same value in `have` (the server adds defaults,
    other managers may add fields: neither is drift)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and is_subset(v, have[k]) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(is_subset(w, h) for w, h in zip(want, have))
    if isinstance(want, (int, float)) and isinstance(have, (int, float)) and not isinstance(want, bool):
        return float(want) == float(have)
    return bool(want == have)


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
         secret: dict[str, Any] | None = None) -> Plan:
    """Actions turning `observed` into `desired`; `secret` is created when absent, adopted when owned by another."""
    actions: list[Action] = []
    if secret is not None:
        have_secret = observed.get(key(secret))
        if have_secret is None:
            actions.append(Create(secret))
        elif _owner_uids(have_secret) != _owner_uids(secret):
            actions.append(Adopt(secret))
    rollout = replicas = None
    for obj in desired:
        have = observed.get(key(obj))
        if have is None:
            actions.append(Apply(obj, "create"))
        elif not is_subset(_essence(obj), have):
            actions.append(Apply(obj, "update"))
        else:
            continue
        if obj["kind"] == "Deployment" and have is not None:
            old_v, new_v = _template_version(have), _template_version(obj)
            if old_v != new_v:
                rollout = (old_v or "", new_v or "")
            old_r, new_r = (have.get("spec") or {}).get("replicas"), obj["spec"]["replicas"]
            if old_r != new_r:
                replicas = (int(old_r or 0), int(new_r))
    return Plan(actions=actions, rollout=rollout, replicas=replicas)
