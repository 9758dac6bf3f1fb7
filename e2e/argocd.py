"""Argo CD's side of the GitOps kit (examples/gitops/argocd-cm.yaml), run here without Argo CD:
the ModelService health check is Lua that Argo CD runs with `obj` bound to the live object and
reads a `{status, message}` table back; `health(obj)` does the same through lupa (real Lua 5.4).
Used by e2e/test_gitops.py on objects the real operator wrote, and by tests/operator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

KIT = Path(__file__).resolve().parents[1] / "examples" / "gitops" / "argocd-cm.yaml"
HEALTH_KEY = "resource.customizations.health.serving.magnitude.dev_ModelService"
IGNORE_KEY = "resource.customizations.ignoreResourceUpdates.serving.magnitude.dev_ModelService"
# The statuses Argo CD knows (gitops-engine's health.HealthStatusCode).
ARGO_STATUSES = frozenset({"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"})


def kit() -> dict[str, str]:
    return yaml.safe_load(KIT.read_text())["data"]


def health(obj: dict[str, Any]) -> dict[str, str]:
    """What Argo CD would show for `obj`: the script's returned table as a dict."""
    from lupa import LuaRuntime

    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(kit()[HEALTH_KEY])
    out = {k: v for k, v in result.items()}
    assert out.get("status") in ARGO_STATUSES, out
    return out
