"""spec.pod on the real control plane: a node selector and a toleration reach the pods and the
real kube-scheduler honours them. The kwok node carries the label `magnitude.dev/pool=inference`
(e2e/cluster.py); this scenario also taints it `magnitude.dev/pool=inference:NoSchedule` while it
runs (every other scenario's pods must still schedule on the one node, so the taint is put on
here and taken off after). With the taint on, a ModelService without the toleration stays
Pending for the scheduler's stated reason, one whose selector matches no node stays Pending for
that reason, and the one with both selector and toleration is scheduled there and becomes Ready.
"""

from __future__ import annotations

import json

from conftest import condition, wait_for
from test_modelservice import debug, delete_and_wait, pods, ready_msvc, sim_service

from cluster import NODE_NAME, NODE_POOL_LABEL

KEY, VALUE = NODE_POOL_LABEL
TAINT = f"{KEY}={VALUE}:NoSchedule"
TOLERATION = {"key": KEY, "operator": "Equal", "value": VALUE, "effect": "NoSchedule"}


def unschedulable_because(kube, name: str) -> str:
    """The scheduler's message on the ModelService's pod while it stays unscheduled ("" until then)."""
    for pod in pods(kube, name):
        c = condition(pod, "PodScheduled") or {}
        if c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return c.get("message", "")
    return ""


def test_node_selector_and_toleration_reach_the_pods(kube, operator, kubelet) -> None:
    placed = sim_service("shape-placed", pod={"nodeSelector": {KEY: VALUE}, "tolerations": [TOLERATION],
                                              "labels": {"team": "ml"}, "annotations": {"cost-center": "42"},
                                              "env": [{"name": "SHAPE_ENV", "value": "1"}]})
    untolerated = sim_service("shape-untolerated", pod={"nodeSelector": {KEY: VALUE}})
    nowhere = sim_service("shape-nowhere", pod={"nodeSelector": {KEY: "training"}, "tolerations": [TOLERATION]})
    kube.run("taint", "node", NODE_NAME, TAINT, "--overwrite")
    try:
        for manifest in (placed, untolerated, nowhere):
            kube.apply(manifest)
        ready_msvc(kube, operator, kubelet, "shape-placed", timeout=90, replicas=1)
        [pod] = pods(kube, "shape-placed")
        spec = pod["spec"]
        assert spec["nodeName"] == NODE_NAME and spec["nodeSelector"] == {KEY: VALUE}
        assert TOLERATION in spec["tolerations"], spec["tolerations"]
        assert pod["metadata"]["labels"]["team"] == "ml" and pod["metadata"]["annotations"]["cost-center"] == "42"
        assert {"name": "SHAPE_ENV", "value": "1"} in spec["containers"][0]["env"]
        why = wait_for("the pod without the toleration left unscheduled",
                       lambda: unschedulable_because(kube, "shape-untolerated"), 60,
                       on_timeout=debug(kube, operator, kubelet, "shape-untolerated"))
        assert "untolerated taint" in why, why
        why = wait_for("the pod whose selector matches no node left unscheduled",
                       lambda: unschedulable_because(kube, "shape-nowhere"), 60,
                       on_timeout=debug(kube, operator, kubelet, "shape-nowhere"))
        assert "node affinity/selector" in why, why
        print(json.dumps({"placed": spec["nodeName"], "untolerated": unschedulable_because(kube, "shape-untolerated"),
                          "nowhere": why}))
    finally:
        kube.run("taint", "node", NODE_NAME, f"{KEY}:NoSchedule-", check=False)
        for name in ("shape-placed", "shape-untolerated", "shape-nowhere"):
            delete_and_wait(kube, name)
