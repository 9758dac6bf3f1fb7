"""The scale-and-shed loop: every sync period, for every known ModelService, scrape its ready pods,
ask the pure autoscaler for a decision, reconcile with it, and tell the engines what to shed.

It runs as one background task started by the operator (not a Kopf timer: a timer would add a
finalizer, and a finalizer blocks deletion whenever the operator is down). The registry is fed by
a Kopf watch-event handler; reconciles of one object are serialized by a per-object lock so a
change handler and a tick never interleave.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from magnitude.operator import naming as n
from magnitude.operator.apply import ApiError, Kube
from magnitude.operator.autoscaler import decide
from magnitude.operator.desired import desired_replicas
from magnitude.operator.engine_client import set_shedding
from magnitude.operator.reconcile import SpecInvalid, parse_spec, parse_status, reconcile
from magnitude.operator.scrape import PodInfo, Scraper, pod_url
from magnitude.operator.status import memory_from_status

log = logging.getLogger(__name__)
SYNC_SECONDS_ENV = "MAGNITUDE_OPERATOR_SYNC_SECONDS"
DEFAULT_SYNC_SECONDS = 10.0

Key = tuple[str, str]  # (namespace, name)


@dataclass
class Entry:
    body: dict[str, Any]
    lock: threading.Lock = field(default_factory=threading.Lock)
    scraper: Scraper = field(default_factory=Scraper)
    token: str | None = None


class Registry:
    """The ModelServices this operator serves, as last seen on the watch stream."""

    def __init__(self) -> None:
        self._entries: dict[Key, Entry] = {}
        self._guard = threading.Lock()

    def entry(self, namespace: str, name: str, body: dict[str, Any] | None = None) -> Entry:
        with self._guard:
            e = self._entries.get((namespace, name))
            if e is None:
                e = self._entries[(namespace, name)] = Entry(body=body or {})
            elif body is not None:
                e.body = body
            return e

    def forget(self, namespace: str, name: str) -> None:
        with self._guard:
            self._entries.pop((namespace, name), None)

    def items(self) -> list[tuple[Key, Entry]]:
        with self._guard:
            return list(self._entries.items())


def sync_seconds() -> float:
    return float(os.environ.get(SYNC_SECONDS_ENV, DEFAULT_SYNC_SECONDS))


def pod_infos(pods: list[dict[str, Any]]) -> list[PodInfo]:
    """Pods that count: terminating ones are already leaving and carry no capacity."""
    out = []
    for p in pods:
        meta, status = p.get("metadata", {}), p.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        out.append(PodInfo(name=meta["name"], uid=meta.get("uid", meta["name"]), ip=status.get("podIP"), ready=ready))
    return out


def shed_stale(pods: list[PodInfo], reported: dict[str, frozenset[str] | None],
               want: frozenset[str]) -> list[PodInfo]:
    """Ready, scraped pods whose shed classes (`magnitude_admission_shed_class`, read from the
    engine itself, so an operator restart or an engine restart needs no memory here) differ from
    `want`, or that do not say."""
    return [p for p in pods if p.ready and p.name in reported and reported[p.name] != want]


async def tick(kube: Kube, entry: Entry, client: httpx.AsyncClient) -> None:
    body = entry.body
    meta = body.get("metadata") or {}
    if not meta or meta.get("deletionTimestamp"):
        return
    namespace, name = meta["namespace"], meta["name"]
    try:
        spec = parse_spec(body)
    except SpecInvalid:
        return  # the change handler has reported it; nothing to scale
    pods = pod_infos(await asyncio.to_thread(kube.list_pods, namespace, n.selector_string(name)))
    loads = await entry.scraper.scrape(client, pods, namespace)
    prev = parse_status(body)
    decision = decide(spec, desired_replicas(spec, prev), loads, memory_from_status(prev), now=time.time())

    def locked() -> None:
        with entry.lock:
            reconcile(kube, body, decision)

    await asyncio.to_thread(locked)
    want = frozenset(decision.shed_classes)
    stale = shed_stale(pods, entry.scraper.shed_reported, want)
    if not stale:
        return
    if entry.token is None:
        entry.token = await asyncio.to_thread(kube.read_admin_token, namespace, name)
    for p in stale:
        url = pod_url(p, namespace)
        if not (url and entry.token):
            continue
        if not await set_shedding(client, url, entry.token, decision.shed_classes):
            log.warning("%s/%s: pod %s did not accept shedding %s", namespace, name, p.name, decision.shed_classes)
            entry.token = None  # re-read next tick, in case the Secret was replaced


async def run(kube: Kube, registry: Registry, stop: asyncio.Event | None = None) -> None:
    """Tick every ModelService each sync period until `stop` is set (or the task is cancelled)."""
    period = sync_seconds()
    async with httpx.AsyncClient() as client:
        while stop is None or not stop.is_set():
            started = time.monotonic()
            entries = registry.items()
            results = await asyncio.gather(*(tick(kube, e, client) for _, e in entries), return_exceptions=True)
            for (key, _), result in zip(entries, results):
                if isinstance(result, ApiError):
                    log.warning("%s/%s: tick failed: %s", *key, result)
                elif isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                    log.error("%s/%s: tick crashed", *key, exc_info=result)
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))
