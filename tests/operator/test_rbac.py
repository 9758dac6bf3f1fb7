"""The chart's RBAC is exactly what the operator uses, read from the real API server's audit log.

The operator runs as a ServiceAccount bound only to the chart's ClusterRole: first the real
`magnitude operator` process (kopf: list, watch and annotate ModelServices, reconcile, the scale
loop), then the calls only a scale-down or a re-created ModelService make, through the same
code. The audit log then must show no request refused, and every granted (group, resource,
verb) used. A server-side apply answered 201 counts as `create` too: the API server authorizes
that verb for it (the audit record names only `patch`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml

from magnitude.operator.apply import ApiError
from magnitude.operator.reconcile import reconcile
from opkit import NAME, ROOT, RULES_FILE, SA_NAMESPACE, ApiServer, Env, e2e_module, used_permissions

pytestmark = pytest.mark.slow


def granted() -> set[tuple[str, str, str]]:
    rules = yaml.safe_load(RULES_FILE.read_text())
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def run_operator(api: Env, apiserver: ApiServer, until, timeout: float = 60.0) -> str:
    """The real operator process, watching this test's namespace, until `until()` holds; returns its log."""
    log = api.server.cluster.state / "logs" / f"operator-{api.ns}.log"
    env = dict(os.environ, KUBECONFIG=str(apiserver.operator_kubeconfig), MAGNITUDE_OPERATOR_SYNC_SECONDS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "server"), str(ROOT / "operator")]))
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "magnitude.cli.main", "operator", "-n", api.ns], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not until():
            assert proc.poll() is None, f"operator exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"operator did not get there in {timeout:.0f}s:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
    finally:
        e2e_module("cluster")._end_group(proc.pid, 20.0, proc)  # SIGTERM the group, SIGKILL after 20 s
    return log.read_text()


def test_chart_rbac_is_exactly_what_the_operator_uses(api: Env, apiserver: ApiServer,
                                                      service_monitors: None) -> None:
    # The account is not an admin: what the chart does not grant is refused.
    with pytest.raises(ApiError) as refused:
        api.kube.get("v1", "Pod", SA_NAMESPACE, "anything")  # pods: list and patch only
    assert refused.value.status == 403

    api.body()
    used = lambda: used_permissions(apiserver.audit(api.ns))  # noqa: E731
    handled = lambda: bool(api.get("Deployment")) and api.status().get("observedGeneration") == 1 and {  # noqa: E731
        ("serving.magnitude.dev", "modelservices", "patch"), ("", "pods", "list")} <= used()
    run_operator(api, apiserver, handled)

    # What only a scale-down and a NetworkPolicy turned on and off do, through the operator's own code.
    api.add_pod("p0", "10.0.0.1")
    api.kube.set_deletion_costs(api.ns, {"p0": 1})
    reconcile(api.kube, api.body(networkPolicy={"enabled": True}))
    assert api.admin.get("networking.k8s.io/v1", "NetworkPolicy", api.ns, NAME) is not None
    reconcile(api.kube, api.body(networkPolicy={"enabled": False}))
    assert api.admin.get("networking.k8s.io/v1", "NetworkPolicy", api.ns, NAME) is None

    events = apiserver.audit(api.ns)
    refused_calls = [(e["verb"], e["requestURI"]) for e in events if e.get("responseStatus", {}).get("code") == 403]
    assert refused_calls == []
    assert used_permissions(events) == granted(), (
        f"used but not granted: {used_permissions(events) - granted()}; "
        f"granted, never used: {granted() - used_permissions(events)}")
