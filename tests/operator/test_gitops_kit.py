"""The Argo CD kit (examples/gitops/argocd-cm.yaml) without a cluster: the health Lua (real Lua
through lupa) on statuses the operator's own `status.build` makes for each reason that decides
health, and the ignoreResourceUpdates pointers naming fields the status really has. The same Lua
on objects the live operator wrote is e2e/test_gitops.py."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from magnitude.operator import status as st
from magnitude.operator.spec import ModelServiceStatus
from magnitude.operator.validation import Problem
from opkit import e2e_module

argocd = e2e_module("argocd")
NOW = "2026-01-01T00:00:00Z"


def deployment(want: int, ready: int, updated: int | None = None, deadline: bool = False) -> dict[str, Any]:
    updated = want if updated is None else updated
    conds = [{"type": "Progressing", "reason": "ProgressDeadlineExceeded", "message": "too slow"}] if deadline else []
    return {"metadata": {"generation": 1}, "spec": {"replicas": want},
            "status": {"observedGeneration": 1, "replicas": max(want, updated), "readyReplicas": ready,
                       "updatedReplicas": updated, "availableReplicas": ready, "conditions": conds}}


def obj(observed: st.Observed, generation: int = 3) -> dict[str, Any]:
    status = st.build(None, generation, observed, None, NOW)
    return {"apiVersion": "serving.magnitude.dev/v1alpha1", "kind": "ModelService",
            "metadata": {"name": "m", "generation": generation}, "status": status.to_document()}


def observed(dep: dict[str, Any] | None, want: int = 2, **kw: Any) -> st.Observed:
    return st.Observed(deployment=dep, desired_replicas=want, service_version="v1", selector="s", **kw)


@pytest.mark.parametrize("case, expected, says", [
    (observed(deployment(2, 2)), "Healthy", "PodsReady: 2/2"),
    (observed(deployment(2, 1, updated=1)), "Progressing", "RollingOut"),
    (observed(deployment(2, 0)), "Progressing", "0 ready"),
    (observed(None, problems=(Problem("spec.resources.gpus", "no"),)), "Degraded", "spec.resources.gpus"),
    (observed(deployment(2, 2), apply_error="403"), "Degraded", "ApplyFailed"),
    (observed(deployment(2, 0, updated=0, deadline=True)), "Degraded", "ProgressDeadlineExceeded"),
    (observed(deployment(0, 0), want=0), "Suspended", "ScaledToZero"),
], ids=["ready", "rolling", "loading", "unsupported", "apply-failed", "deadline", "parked"])
def test_health_follows_the_operators_conditions(case: st.Observed, expected: str, says: str) -> None:
    got = argocd.health(obj(case))
    assert got["status"] == expected and says in got["message"], got


def test_a_status_older_than_the_spec_or_none_is_progressing() -> None:
    stale = obj(observed(deployment(2, 2)))
    stale["metadata"]["generation"] = 4
    assert argocd.health(stale)["status"] == "Progressing"
    assert argocd.health({"metadata": {"name": "m", "generation": 1}})["status"] == "Progressing"


def test_ignored_status_fields_exist_and_leave_health_fields_watched() -> None:
    ignore = yaml.safe_load(argocd.kit()[argocd.IGNORE_KEY])
    fields = {f.alias for f in ModelServiceStatus.model_fields.values()}
    for pointer in ignore["jsonPointers"]:
        _, top, name = pointer.split("/")
        assert top == "status" and name in fields, pointer
        assert name not in {"conditions", "observedGeneration", "replicas", "readyReplicas"}, pointer
    assert argocd.kit()["resource.ignoreResourceUpdatesEnabled"] == "true"
