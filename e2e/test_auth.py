"""spec.auth on the real control plane (issue 11, "Who is the tenant?"): a ModelService in mode
apiKeys whose keys live in a Secret the operator never reads. The stand-in kubelet mounts the
Secret's key as the keys file (and keeps it current, as a kubelet does for a folder mount); the
engine behind the pod serves a request with a key from the Secret and refuses one without; the
operator's scrapes and admin calls, which carry no API key, still work; editing the Secret
rotates the keys without restarting or rolling the pod.
"""

from __future__ import annotations

import base64

import httpx

from conftest import condition, wait_for
from test_modelservice import NS, debug, delete_and_wait, msvc, pods, ready_msvc, sim_service

OLD_KEY = "sk-acme-0123456789abcdef"
NEW_KEY = "sk-acme-fedcba9876543210"


def keys_secret(name: str, key: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS},
            "stringData": {"keys.yaml": f"keys:\n  - key: {key}\n    tenant: acme\n"}}


def complete(url: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=30,
                      json={"model": "simulated", "prompt": "hi", "max_tokens": 2})


def test_api_keys_from_a_secret_authenticate_and_rotate_without_a_restart(kube, operator, kubelet) -> None:
    name, secret = "auth-keys", "auth-keys-file"
    kube.apply(keys_secret(secret, OLD_KEY))
    try:
        kube.apply(sim_service(name, replicas=1, minReplicas=1, maxReplicas=1,
                               autoscaling={"enabled": True, "metricsMaxAgeSeconds": 10},
                               auth={"mode": "apiKeys", "apiKeysSecretRef": {"name": secret, "key": "keys.yaml"}}))
        ready_msvc(kube, operator, kubelet, name, timeout=120, replicas=1)  # /readyz needs no key
        dump = debug(kube, operator, kubelet, name)
        [pod] = pods(kube, name, ready_only=True)
        url = f"http://{pod['status']['podIP']}:8000"
        model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {OLD_KEY}"},
                          timeout=10).json()["data"][0]["id"]
        assert model == "simulated"
        assert complete(url, OLD_KEY).status_code == 200
        refused = complete(url, None)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", refused.text
        assert complete(url, "sk-not-a-key-0123456789").status_code == 401
        # The operator's own calls carry no API key: its scrapes count (the Scaling condition judges
        # the pod's metrics, not "unavailable"), and /admin answers the admin token.
        wait_for("the operator scraping the pod", lambda: (msvc(kube, name)["status"].get("load") or {})
                 .get("podsScraped") == 1 and (condition(msvc(kube, name), "Scaling") or {}).get("reason")
                 not in (None, "MetricsUnavailable", "AwaitingMetrics"), 30, on_timeout=dump)
        env = {e["name"]: e for e in kube.get("deployment", name)["spec"]["template"]["spec"]["containers"][0]["env"]}
        ref = env["MAGNITUDE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
        token = base64.b64decode(kube.get("secret", ref["name"])["data"][ref["key"]]).decode()
        assert httpx.get(f"{url}/admin/shedding", headers={"Authorization": f"Bearer {token}"}, timeout=10).status_code == 200
        assert httpx.get(f"{url}/admin/shedding", headers={"Authorization": f"Bearer {OLD_KEY}"},
                         timeout=10).status_code == 401  # an API key is not the admin token
        # Rotation: edit the Secret; the same process picks the new keys up.
        generation = kube.get("deployment", name)["metadata"]["generation"]
        pid = kubelet.engines[f"{NS}/{pod['metadata']['name']}"].proc.pid
        kube.apply(keys_secret(secret, NEW_KEY))
        wait_for("the new key accepted", lambda: complete(url, NEW_KEY).status_code == 200, 30, on_timeout=dump)
        assert complete(url, OLD_KEY).status_code == 401
        [after] = pods(kube, name)
        assert after["metadata"]["uid"] == pod["metadata"]["uid"], "rotation replaced the pod"
        assert (after["status"]["containerStatuses"][0].get("restartCount") or 0) == 0
        assert kubelet.engines[f"{NS}/{pod['metadata']['name']}"].proc.pid == pid
        assert kube.get("deployment", name)["metadata"]["generation"] == generation, "rotation rolled the pods"
        print(f"\nauth: apiKeys from Secret {secret}: with key 200, without 401, wrong key 401; operator scrapes "
              f"counted, admin token 200; rotated in place (pod, process and Deployment generation unchanged)")
        delete_and_wait(kube, name)
    finally:
        kube.delete("secret", secret)
