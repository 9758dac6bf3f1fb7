"""A model from the hub, end to end on the real control plane: a ModelService whose source is
`hf://` with a revision and a token Secret, served from a hub stand-in on loopback (the real
Hugging Face hub cannot be reached from here; tests/runner/hub_standin.py answers the real
`huggingface_hub` client as the hub does, and needs the token), with its model cache on a
PersistentVolumeClaim bound to a static hostPath PV, which the stand-in kubelet backs with one
folder shared by every pod (e2e/kubelet.py). The engines run the real runner on a tiny random
Llama built in the test. The first pod downloads; scaled to two replicas, the second pod becomes
ready from the cache without downloading a byte; status.model reports the commit SHA the tag
resolved to. First- and second-pod ready times are printed. Second test: a `pvc://` source, a
tiny model pre-staged on a volume, mounted read-only from its claim and served.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import httpx

from conftest import REPO, wait_for
from test_modelservice import NS, debug, delete_and_wait, msvc, pods, ready_msvc

TOKEN = "hf_e2e_standin_token"
HUB_REPO = "tiny-org/tiny-llama"


def _runner_module(name: str):
    """tests/runner/<name>.py by path (tests/ is not a package the e2e suite imports)."""
    spec = importlib.util.spec_from_file_location(f"magnitude_e2e_{name}", REPO / "tests" / "runner" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def file_downloads(hub) -> int:
    return sum(1 for method, path in list(hub.requests) if method == "GET" and "/resolve/" in path)


def static_claim(claim: str, pv: str, folder: Path, mode: str) -> list[dict]:
    """A PersistentVolume on a local folder (hostPath) pre-bound to a claim of that name, as an
    admin stages one by hand; the stand-in kubelet backs the claim with that folder."""
    return [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": [mode], "storageClassName": "",
                  "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(folder)},
                  "claimRef": {"namespace": NS, "name": claim}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": NS},
         "spec": {"accessModes": [mode], "storageClassName": "", "volumeName": pv,
                  "resources": {"requests": {"storage": "1Gi"}}}},
    ]


def remove(kube, kubelet, name: str, objects: list[dict]) -> None:
    kubelet.runner_for.pop(name, None)
    if msvc(kube, name) is not None:
        delete_and_wait(kube, name, timeout=90)
    for obj in reversed(objects):
        kube.run("delete", obj["kind"].lower(), obj["metadata"]["name"], "-n", NS, "--wait=false",
                 "--ignore-not-found", check=False)


def test_hub_model_two_replicas_second_from_the_cache(kube, operator, kubelet, tmp_path: Path) -> None:
    tiny = _runner_module("tiny_models")
    hub = _runner_module("hub_standin").HubStandIn(token=TOKEN)
    sha = hub.repo(HUB_REPO).add_commit(tiny.build_tiny_model("llama", tmp_path / "tiny", seed=1), refs=("v1",))
    hub.start()
    name, claim, pv = "hub-model", "hub-model-cache", f"hub-model-cache-{os.getpid()}"
    cache_dir = tmp_path / "pv"
    kubelet.runner_for[name] = "real"
    objects = [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hub-token", "namespace": NS},
         "stringData": {"token": TOKEN}},
        *static_claim(claim, pv, cache_dir, "ReadWriteMany"),
    ]
    service = {
        "apiVersion": "serving.magnitude.dev/v1alpha1", "kind": "ModelService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"source": f"hf://{HUB_REPO}", "revision": "v1", "servedModelName": "tiny-chat",
                      "tokenSecretRef": {"name": "hub-token", "key": "token"}},
            "modelCache": {"claimName": claim},
            "replicas": 1,
            "resources": {"cpu": "100m", "memory": "256Mi"},
            "scheduler": {"maxSequences": 2, "tokenBudget": 64, "prefillChunkSize": 32},
            "kvCache": {"numBlocks": 64},
            "drainSeconds": 0,
            "pod": {"env": [{"name": "HF_ENDPOINT", "value": hub.url}, {"name": "HF_HUB_DISABLE_XET", "value": "1"}]},
        },
    }
    try:
        for obj in objects:
            kube.apply(obj)
        t0 = time.monotonic()
        kube.apply(service)
        ready_msvc(kube, operator, kubelet, name, timeout=240, replicas=1)
        first_ready = time.monotonic() - t0
        downloaded = file_downloads(hub)
        assert downloaded > 0, hub.requests
        assert any(p.is_dir() for p in (cache_dir / "models").iterdir()), "nothing cached on the claim's folder"
        dump = debug(kube, operator, kubelet, name)
        wait_for("status.model with the resolved commit", lambda: (msvc(kube, name)["status"].get("model") or {})
                 .get("revision") == sha, 60, on_timeout=dump)
        assert msvc(kube, name)["status"]["model"]["source"] == f"hf://{HUB_REPO}@v1"
        [first] = pods(kube, name)
        t1 = time.monotonic()
        kube.run("scale", "modelservice", name, "-n", NS, "--replicas=2")
        ready_msvc(kube, operator, kubelet, name, timeout=240, replicas=2)
        second_ready = time.monotonic() - t1
        assert file_downloads(hub) == downloaded, "the second pod downloaded again instead of using the cache"
        [second] = [p for p in pods(kube, name) if p["metadata"]["name"] != first["metadata"]["name"]]
        url = f"http://{second['status']['podIP']}:8000"
        listed = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in listed] == ["tiny-chat"] and listed[0]["revision"] == sha, listed
        answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny-chat", "prompt": "t5 t9 t44", "max_tokens": 4, "temperature": 0})
        assert answer.status_code == 200, answer.text
        print(json.dumps({"first_pod_ready_s": round(first_ready, 1), "second_pod_ready_s": round(second_ready, 1),
                          "hub_file_downloads": downloaded, "revision": sha}))
    finally:
        remove(kube, kubelet, name, objects)
        hub.stop()


def test_pvc_source_is_served_from_the_claim(kube, operator, kubelet, tmp_path: Path) -> None:
    """`pvc://CLAIM/PATH`: a tiny random Llama already on a volume (a static hostPath PV, the way
    weights are pre-staged on a cluster) is mounted from its claim and served under its served
    name; the Deployment mounts the claim read-only and hands the engine the plain path."""
    tiny = _runner_module("tiny_models")
    volume = tmp_path / "weights"
    tiny.build_tiny_model("llama", volume / "llama" / "tiny", seed=3)
    name, claim, pv = "pvc-model", "pvc-weights", f"pvc-weights-{os.getpid()}"
    kubelet.runner_for[name] = "real"
    objects = static_claim(claim, pv, volume, "ReadOnlyMany")
    service = {
        "apiVersion": "serving.magnitude.dev/v1alpha1", "kind": "ModelService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {"source": f"pvc://{claim}/llama/tiny", "servedModelName": "tiny-from-pvc"},
                 "replicas": 1, "resources": {"cpu": "100m", "memory": "256Mi"},
                 "scheduler": {"maxSequences": 2, "tokenBudget": 64, "prefillChunkSize": 32},
                 "kvCache": {"numBlocks": 64}, "drainSeconds": 0},
    }
    try:
        for obj in objects:
            kube.apply(obj)
        kube.apply(service)
        ready_msvc(kube, operator, kubelet, name, timeout=240, replicas=1)
        [pod] = pods(kube, name)
        container = pod["spec"]["containers"][0]
        assert container["args"][container["args"].index("--model") + 1] == f"/models/{claim}/llama/tiny"
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["model-source"]["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
        url = f"http://{pod['status']['podIP']}:8000"
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]] == ["tiny-from-pvc"]
        answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny-from-pvc", "prompt": "t5 t9 t44", "max_tokens": 4, "temperature": 0})
        assert answer.status_code == 200, answer.text
    finally:
        remove(kube, kubelet, name, objects)
