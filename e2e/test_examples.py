"""Every manifest under examples/ is accepted by the real API server and, applied as a user
would, becomes a Ready ModelService (engines on the simulated runner; the CPU example's real
model is scenario 2's job). All examples go in at once to keep the suite short."""

from __future__ import annotations

import yaml

from conftest import REPO, condition, wait_for

NS = "default"


def test_every_example_applies_and_becomes_ready(kube, operator, kubelet) -> None:
    paths = sorted((REPO / "examples").glob("*.yaml"))
    assert paths, "no examples"
    services: dict[str, str] = {}
    for path in paths:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        dry = kube.run("apply", "--dry-run=server", "-n", NS, "-f", str(path), check=False)
        assert dry.returncode == 0, f"{path.name} refused by the API server: {dry.stderr}"
        for doc in docs:
            if doc["kind"] == "ModelService":
                services[doc["metadata"]["name"]] = path.name
    assert services, "no ModelService in examples/"
    try:
        for path in paths:
            kube.apply(path, "-n", NS)

        def not_ready() -> list[str]:
            waiting = []
            for name in services:
                ms = kube.get("modelservice", name, check=False)
                if (condition(ms, "Ready") or {}).get("status") != "True":
                    waiting.append(f"{name} ({services[name]}): {(ms or {}).get('status', {}).get('conditions')}")
            return waiting

        wait_for("every example Ready", lambda: not not_ready(), 180, on_timeout=lambda: "\n".join(not_ready()))
        for name in services:
            ms = kube.get("modelservice", name)
            assert ms["status"]["readyReplicas"] >= 1, (name, ms["status"])
            assert ms["status"]["serviceVersion"], name
    finally:
        for path in paths:
            kube.run("delete", "-n", NS, "-f", str(path), "--ignore-not-found", "--wait=false", check=False)
    wait_for("example pods gone", lambda: not kube.get(
        "pods", selector="app.kubernetes.io/name=magnitude-engine")["items"], 90)
