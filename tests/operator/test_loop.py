"""The scale-and-shed loop, tick by tick, against a real kube-apiserver and real engines.

Each pod is made from the operator's own pod template and run by the e2e harness's kubelet as a
real `magnitude serve --runner simulated` process at the pod's loopback IP (the real server,
scheduler, admission and /metrics with a cost model for the forward pass); load comes from the
e2e load generator over HTTP. The test plays the ReplicaSet (it adds the pod the new replica
count asks for); everything else is the operator's code: list pods, scrape, decide, reconcile,
POST /admin/shedding with the token from the Secret."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from magnitude.operator import loop
from magnitude.operator import naming as n
from magnitude.operator.reconcile import reconcile
from opkit import NAME, ApiServer, Env, e2e_module

pytestmark = pytest.mark.slow

CLASSES = [{"name": "interactive", "priority": 0}, {"name": "batch", "priority": 10}]
SPEC: dict[str, Any] = {
    "replicas": 1, "minReplicas": 1, "maxReplicas": 2,
    "resources": {"cpu": "100m", "memory": "256Mi"},
    # Small on purpose, so a modest load queues.
    "scheduler": {"maxSequences": 2, "tokenBudget": 256, "prefillChunkSize": 128,
                  "priorityClasses": CLASSES, "defaultPriorityClass": "interactive"},
    "drainSeconds": 0,
    "extraArgs": ["--time-scale", "2"],
    "autoscaling": {"enabled": True, "targetQueueTimeSeconds": 0.5, "scaleDownStabilizationSeconds": 300},
    "loadShedding": {"enabled": True, "queueTimeOnSeconds": 1.0, "queueTimeOffSeconds": 0.5,
                     "kvUsageOn": 0.99, "kvUsageOff": 0.9, "stepSeconds": 60},  # no flapping in the test's span
}


def pod_ips() -> list[str]:
    """Loopback addresses of this process's own /24 (the harness's per-run pod CIDR)."""
    net = ipaddress.ip_network(e2e_module("cluster").pod_cidr_for(os.getpid()))
    return [str(net.network_address + 10 + i) for i in range(2)]


def ready(api: Env, name: str) -> bool:
    pod = api.get("Pod", name) or {}
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions") or [])


def wait(what: str, probe: Callable[[], Any], timeout: float, dump: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{dump()}", pytrace=False)


def ticks_until(api: Env, entry: loop.Entry, done: Callable[[], bool], timeout: float, dump: Callable[[], str],
                extra: int = 0) -> int:
    """Run loop ticks (one a second, as with a short sync period) until `done`, then `extra` more."""
    async def go() -> int:
        count, after = 0, 0
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline and after <= extra:
                entry.body = api.current()  # what the watch would have delivered
                await loop.tick(api.kube, entry, client)
                count += 1
                if after or done():
                    after += 1
                await asyncio.sleep(1.0)
        return count
    count = asyncio.run(go())
    if not done():
        pytest.fail(f"not reached after {count} ticks in {timeout:.0f}s\n{dump()}", pytrace=False)
    return count


def shed_posts(log: Path) -> int:
    """How many shedding changes the engine accepted (it logs each one)."""
    return log.read_text(errors="replace").count("load shedding on") if log.exists() else 0


def test_busy_pods_scale_up_then_at_max_shed_the_lowest_class(api: Env, apiserver: ApiServer,
                                                              tmp_path: Path) -> None:
    Kubelet = e2e_module("kubelet").Kubelet
    Load = e2e_module("load").Load
    reconcile(api.kube, api.body(**SPEC))
    kubelet = Kubelet(kubeconfig=apiserver.cluster.kubeconfig, workdir=tmp_path).start()
    ips = pod_ips()
    urls = lambda: [f"http://{ip}:{n.ENGINE_PORT}" for ip, p in zip(ips, ("p0", "p1")) if ready(api, p)]  # noqa: E731
    logs = [tmp_path / f"{api.ns}_{p}.log" for p in ("p0", "p1")]
    entry = loop.Entry(body=api.current())
    load = None

    def dump() -> str:
        conds = {c["type"]: (c["status"], c["reason"]) for c in api.status().get("conditions", [])}
        tails = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-1500:]}" for p in logs if p.exists())
        return (f"conditions: {conds}\nload: {api.status().get('load')}\nrequests: {load and load.statuses}\n"
                f"kubelet errors: {kubelet.errors[-5:]}\n{tails}")
    try:
        api.add_pod("p0", ips[0], node=kubelet_node(), ready=False)
        wait("p0 Ready (engine up)", lambda: ready(api, "p0"), 90, dump)
        load = Load(urls, concurrency=16, max_tokens=48, max_seconds=240, priority_class="batch").start()

        ticks_until(api, entry, lambda: api.get("Deployment")["spec"]["replicas"] == 2, 90, dump)
        assert api.cond("Scaling")["reason"] == "ScaledUp"
        assert api.cond("Shedding")["status"] == "False" and shed_posts(logs[0]) == 0  # could still grow

        api.add_pod("p1", ips[1], node=kubelet_node(), ready=False)  # what the ReplicaSet would do
        wait("p1 Ready (engine up)", lambda: ready(api, "p1"), 90, dump)
        # The Scaling reason is read at the tick that turns shedding on: once batch requests are
        # refused, load falls and a later tick may rightly be stabilizing a scale-down instead.
        scaling_when_shed: list[str] = []

        def shedding_on() -> bool:
            if api.cond("Shedding")["status"] != "True":
                return False
            if not scaling_when_shed:
                scaling_when_shed.append(api.cond("Scaling")["reason"])
            return True
        ticks_until(api, entry, shedding_on, 120, dump, extra=2)
        assert scaling_when_shed == ["AtMaxReplicas"]
        assert [shed_posts(log) for log in logs] == [1, 1]  # both told once; no repeats on later ticks
        token = api.admin_token()
        for url in urls():
            got = httpx.get(f"{url}/admin/shedding", headers={"authorization": f"Bearer {token}"}, timeout=10)
            assert got.json()["shed_classes"] == ["batch"], got.text
        wait("batch requests refused with 429", lambda: load.statuses[429] > 0, 30, dump)
    finally:
        if load is not None:
            load.stop()
        kubelet.stop()
    leaked = e2e_module("cluster").processes_mentioning(tmp_path)  # engines run with their files in tmp_path
    assert leaked == [], f"engine processes left running: {leaked}"
    reasons = {e["reason"] for e in api.events()}
    assert {"ScaledUp", "SheddingStarted", "AtMaxReplicas"} <= reasons, reasons
    observed = api.status()["load"]
    assert observed["podsScraped"] == 2 and 0.0 <= observed["kvUsage"] <= 1.0 and observed["running"] > 0, observed


def kubelet_node() -> str:
    return e2e_module("kubelet").NODE_NAME
