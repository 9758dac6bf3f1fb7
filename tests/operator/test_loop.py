"""One tick of the scale-and-shed loop end to end inside the process: API boundary in memory,
engine pods served by the real engine metrics adapter over a mock pod network."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from magnitude.operator import loop
from magnitude.operator import naming as n
from magnitude.operator.reconcile import reconcile
from magnitude.server.metrics import EngineMetrics
from opkit import DEP_PATH, MS_PATH, NS, FakeApiServer, body, cond, current


def engine(kv_used: int, waiting: int) -> EngineMetrics:
    m = EngineMetrics(registry=CollectorRegistry())
    m.set_gauges(SimpleNamespace(duration_s=0.01, running=4, waiting=waiting, swapped=0, kv_used_blocks=kv_used,
                                 kv_total_blocks=100, preempted=[]))
    return m


def add_ready_pods(api: FakeApiServer, count: int) -> None:
    for i in range(count):
        api.add(f"/api/v1/namespaces/{NS}/pods/p{i}", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"p{i}", "namespace": NS, "uid": f"u{i}", "labels": n.selector_labels("chat")},
            "status": {"podIP": f"10.0.0.{i + 1}", "conditions": [{"type": "Ready", "status": "True"}]}})


def run_ticks(api: FakeApiServer, engines: dict[str, EngineMetrics], ticks: int,
              posts: list[tuple[str, dict[str, Any], str]]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        m = engines[request.url.host]
        if request.url.path == "/admin/shedding":
            doc = json.loads(request.content)
            posts.append((request.url.host, doc, request.headers["authorization"]))
            m.set_shedding(doc["classes"])
            return httpx.Response(200, json={"shed": doc["classes"]})
        return httpx.Response(200, text=m.exposition()[0].decode())

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            entry = loop.Entry(body=current(api), scraper=loop.Scraper(client))
            for _ in range(ticks):
                entry.body = current(api)
                await loop.tick(api, entry, client)

    asyncio.run(go())


def test_busy_pods_scale_up_then_at_max_shed_the_lowest_class() -> None:
    api = FakeApiServer()
    reconcile(api, body(api, minReplicas=1, maxReplicas=2, autoscaling={"enabled": True, "targetKvUsage": 0.5},
                        loadShedding={"kvUsageOn": 0.9, "kvUsageOff": 0.5}))
    add_ready_pods(api, 1)
    engines = {"10.0.0.1": engine(kv_used=95, waiting=20)}
    posts: list[tuple[str, dict[str, Any], str]] = []
    run_ticks(api, engines, 1, posts)
    assert api.objects[DEP_PATH]["spec"]["replicas"] == 2  # kv 0.95 / target 0.5 -> 2 (max)
    assert cond(api, "Scaling")["reason"] == "ScaledUp" and posts == []  # could still grow: no shedding
    add_ready_pods(api, 2)
    engines["10.0.0.2"] = engine(kv_used=95, waiting=20)
    run_ticks(api, engines, 1, posts)
    assert cond(api, "Shedding")["status"] == "True" and cond(api, "Scaling")["reason"] == "AtMaxReplicas"
    token = api.read_admin_token(NS, "chat")
    assert sorted(host for host, _, _ in posts) == ["10.0.0.1", "10.0.0.2"]
    assert all(doc == {"enabled": True, "classes": ["batch"]} and auth == f"Bearer {token}" for _, doc, auth in posts)
    run_ticks(api, engines, 1, posts)
    assert len(posts) == 2  # engines already report the shed class: no repeat calls
    reasons = [e["reason"] for e in api.events]
    assert "ScaledUp" in reasons and "SheddingStarted" in reasons and "AtMaxReplicas" in reasons
    assert api.objects[MS_PATH]["status"]["load"]["kvUsage"] == 0.95
