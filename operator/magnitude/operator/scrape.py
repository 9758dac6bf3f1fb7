"""Scraping engine pods' /metrics into `autoscaler.PodLoad`s.

`parse()` reads the Prometheus text format with prometheus_client's parser and sums series over
their labels; `Scraper` keeps each pod's previous queue-time histogram so the autoscaler sees only
the observations since the last tick (a cumulative histogram would never let a service scale down).
Fetching is plain async HTTP with a short timeout; a pod that does not answer has no fresh metrics.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from magnitude.operator import naming as n
from magnitude.operator.autoscaler import PodLoad

# The engine series the operator reads (DESIGN §3 Metrics).
KV_USAGE = "magnitude_kv_cache_usage_ratio"
WAITING = "magnitude_requests_waiting"
RUNNING = "magnitude_requests_running"
QUEUE_TIME = "magnitude_queue_time_seconds"
SHED_CLASS = "magnitude_admission_shed_class"
READ_METRICS = (KV_USAGE, WAITING, RUNNING, QUEUE_TIME, SHED_CLASS)

# Where a pod's engine answers. The e2e harness may point this elsewhere (kwok pods run no process).
URL_TEMPLATE_ENV = "MAGNITUDE_OPERATOR_POD_URL"
DEFAULT_URL_TEMPLATE = "http://{ip}:{port}"
SCRAPE_TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True)
class PodMetrics:
    kv_usage: float | None = None
    waiting: float = 0.0
    running: float = 0.0
    queue_cumulative: dict[float, float] = field(default_factory=dict)  # le -> cumulative count (all labels)
    shed_classes: frozenset[str] | None = None  # None: the engine does not export the series


@dataclass(frozen=True)
class PodInfo:
    """The parts of a pod the scraper needs (from the API module's pod listing)."""

    name: str
    uid: str
    ip: str | None
    ready: bool


def parse(text: str) -> PodMetrics:
    """Sum each series over its labels; histogram buckets keyed by their upper bound."""
    gauges: dict[str, float] = {}
    buckets: dict[float, float] = {}
    shed: set[str] | None = None
    for family in text_string_to_metric_families(text):
        if family.name not in READ_METRICS:
            continue
        if family.name == SHED_CLASS:
            shed = {s.labels.get("priority_class", "") for s in family.samples if s.value >= 0.5}
            continue
        for sample in family.samples:
            if sample.name == QUEUE_TIME + "_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name == family.name:
                gauges[family.name] = gauges.get(family.name, 0.0) + sample.value
    return PodMetrics(kv_usage=gauges.get(KV_USAGE), waiting=gauges.get(WAITING, 0.0),
                      running=gauges.get(RUNNING, 0.0), queue_cumulative=buckets,
                      shed_classes=None if shed is None else frozenset(shed))


def bucket_delta(prev: dict[float, float] | None, cur: dict[float, float]) -> tuple[tuple[float, float], ...]:
    """Per-bucket (non-cumulative) observations between two cumulative snapshots. With no previous
    snapshot, or after a counter reset (engine restart), there is no interval to speak of: empty."""
    if prev is None or any(cur.get(le, 0.0) < c for le, c in prev.items()):
        return ()
    out: list[tuple[float, float]] = []
    below = 0.0
    for le in sorted(cur):
        cum = cur[le] - prev.get(le, 0.0)
        out.append((le, max(0.0, cum - below)))
        below = max(below, cum)
    return tuple(out)


def pod_url(pod: PodInfo, namespace: str) -> str | None:
    template = os.environ.get(URL_TEMPLATE_ENV, DEFAULT_URL_TEMPLATE)
    if pod.ip is None and "{ip}" in template:
        return None
    return template.format(ip=pod.ip, port=n.ENGINE_PORT, name=pod.name, namespace=namespace)


@dataclass
class _Seen:
    at: float
    metrics: PodMetrics


class Scraper:
    """Scrapes pods and turns them into PodLoads; remembers each pod's last histogram."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._last: dict[str, _Seen] = {}
        self.shed_reported: dict[str, frozenset[str] | None] = {}  # pod name -> classes it sheds

    async def scrape(self, client: httpx.AsyncClient, pods: list[PodInfo], namespace: str) -> list[PodLoad]:
        """Fetch every ready pod over `client` (the loop's shared one: connections are reused)."""
        ready = [p for p in pods if p.ready]
        urls = [pod_url(p, namespace) for p in ready]
        texts = await asyncio.gather(*(_fetch(client, u) if u else _none() for u in urls))
        now = self._clock()
        fresh: dict[str, tuple[PodMetrics, tuple[tuple[float, float], ...]]] = {}
        for pod, text in zip(ready, texts):
            if text is None:
                continue
            try:
                metrics = parse(text)
            except ValueError:
                continue
            prev = self._last.get(pod.uid)
            fresh[pod.uid] = (metrics, bucket_delta(prev.metrics.queue_cumulative if prev else None,
                                                     metrics.queue_cumulative))
            self._last[pod.uid] = _Seen(now, metrics)
        alive = {p.uid for p in pods}
        self._last = {uid: s for uid, s in self._last.items() if uid in alive}
        self.shed_reported = {p.name: fresh[p.uid][0].shed_classes for p in ready if p.uid in fresh}
        loads: list[PodLoad] = []
        for p in pods:
            seen = self._last.get(p.uid)
            if not p.ready or seen is None:
                loads.append(PodLoad(name=p.name, ready=p.ready))
                continue
            metrics, delta = fresh.get(p.uid, (seen.metrics, ()))
            loads.append(PodLoad(name=p.name, ready=True, age=now - seen.at, kv_usage=metrics.kv_usage,
                                 waiting=metrics.waiting, running=metrics.running, queue_buckets=delta))
        return loads


async def _fetch(client: httpx.AsyncClient, url: str) -> str | None:
    try:
        resp = await client.get(url + "/metrics", timeout=SCRAPE_TIMEOUT_SECONDS)
        return resp.text if resp.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def _none() -> None:
    return None
