"""The GitOps kit against objects the real operator wrote: Argo CD's ModelService health check
(examples/gitops/argocd-cm.yaml, run through lupa by `argocd.health`) judges live ModelServices
on the real control plane in each state it must tell apart: a serving service (Healthy), one whose
engine never becomes ready (Progressing), one whose spec the operator refuses (Degraded, naming
the field), and one parked at `replicas: 0` (Suspended).
"""

from __future__ import annotations

from argocd import health
from conftest import condition, wait_for
from test_modelservice import debug, delete_and_wait, msvc, ready_msvc, sim_service


def cond(kube, name: str, type_: str) -> dict:
    return condition(msvc(kube, name), type_) or {}


def test_argocd_health_check_on_live_modelservices(kube, operator, kubelet) -> None:
    services = {
        "gitops-healthy": sim_service("gitops-healthy"),
        # argparse refuses the value, the engine exits and restarts, and no pod ever becomes ready.
        "gitops-progressing": sim_service("gitops-progressing", extraArgs=["--time-scale", "not-a-number"]),
        "gitops-degraded": sim_service("gitops-degraded", extraArgs=["--auth-mode", "none"]),
        "gitops-parked": sim_service("gitops-parked", replicas=0),
    }
    for manifest in services.values():
        kube.apply(manifest)
    try:
        ready_msvc(kube, operator, kubelet, "gitops-healthy", timeout=90, replicas=1)
        wait_for("Degraded on the refused spec", lambda: cond(kube, "gitops-degraded", "Degraded").get("status")
                 == "True", 60, on_timeout=debug(kube, operator, kubelet, "gitops-degraded"))
        wait_for("the never-ready service rolling out", lambda: cond(kube, "gitops-progressing", "Progressing")
                 .get("status") == "True", 60, on_timeout=debug(kube, operator, kubelet, "gitops-progressing"))
        wait_for("the parked service reported", lambda: cond(kube, "gitops-parked", "Ready").get("reason")
                 == "ScaledToZero", 60, on_timeout=debug(kube, operator, kubelet, "gitops-parked"))
        seen = {name: health(msvc(kube, name)) for name in services}
        assert seen["gitops-healthy"]["status"] == "Healthy", seen
        assert seen["gitops-healthy"]["message"].startswith("PodsReady: 1/1"), seen
        assert seen["gitops-progressing"]["status"] == "Progressing", seen
        assert seen["gitops-degraded"]["status"] == "Degraded", seen
        assert "UnsupportedSpec" in seen["gitops-degraded"]["message"], seen
        assert "spec.extraArgs" in seen["gitops-degraded"]["message"], seen
        assert seen["gitops-parked"]["status"] == "Suspended", seen
        # A spec change the operator has not yet observed is Progressing, whatever the conditions say.
        stale = msvc(kube, "gitops-healthy")
        stale["metadata"]["generation"] = stale["status"]["observedGeneration"] + 1
        assert health(stale)["status"] == "Progressing"
        print({name: h["status"] for name, h in seen.items()})
    finally:
        for name in services:
            delete_and_wait(kube, name)
