"""The control plane itself: a kwok node is Ready, and a plain Deployment gets Pods that
are scheduled, Running, served by a real process at their pod IP, and Ready only once
that process answers its readiness probe."""

from __future__ import annotations

import sys
import urllib.request

from conftest import wait_for


def test_kwok_node_ready(kube) -> None:
    nodes = kube.get("nodes", namespace=None)["items"]
    assert [n["metadata"]["name"] for n in nodes] == ["kwok-node-0"]
    ready = {c["type"]: c["status"] for c in nodes[0]["status"]["conditions"]}
    assert ready.get("Ready") == "True"


def test_deployment_pods_run_real_processes(kube, kubelet) -> None:
    name = "cp-smoke"
    deploy = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{
                    "name": "web", "image": "python:3",
                    "command": [sys.executable, "-m", "http.server", "8080", "--bind", "0.0.0.0"],
                    "ports": [{"containerPort": 8080}],
                    "readinessProbe": {"httpGet": {"path": "/", "port": 8080}},
                }]},
            },
        },
    }
    kube.apply(deploy)
    try:
        def ready_pods():
            pods = kube.get("pods", selector=f"app={name}")["items"]
            ok = [p for p in pods if p["status"].get("phase") == "Running" and any(
                c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
            return ok if len(ok) == 2 else None

        pods = wait_for("2 Ready pods", ready_pods, 60)
        ips = sorted(p["status"]["podIP"] for p in pods)
        assert len(set(ips)) == 2 and all(ip.startswith("127.") for ip in ips)
        for ip in ips:
            with urllib.request.urlopen(f"http://{ip}:8080/", timeout=5) as resp:
                assert resp.status == 200
        deploy_obj = wait_for("deployment available", lambda: (
            d := kube.get("deployment", name))["status"].get("availableReplicas") == 2 and d, 30)
        assert deploy_obj["status"]["readyReplicas"] == 2
    finally:
        kube.delete("deployment", name)
    wait_for("pods gone", lambda: not kube.get("pods", selector=f"app={name}")["items"], 60)
    wait_for("processes stopped", lambda: not any(k.startswith("default/cp-smoke") for k in kubelet.engines), 20)
