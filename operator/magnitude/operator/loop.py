"""The scale-and-shed loop: every sync period, for every known ModelService, scrape its ready pods
(and read /readyz of the others, of all of them when the weights are quantized), ask the pure
autoscaler for a decision, reconcile with it and the pods' reports, and tell the engines what to shed.

It runs as one background task started by the operator (not a Kopf timer: a timer would add a
finalizer, and a finalizer blocks deletion whenever the operator is down). The registry is fed by
a Kopf watch-event handler; reconciles of one object are serialized by a per-object lock so a
change handler and a tick never interleave.

Services never wait for each other: each period starts a tick task per ModelService and does not
wait for it; a service whose previous tick is still running skips that period (and says so) while
the others tick on time. Every step of a tick is bounded (API calls and pod requests have
deadlines and byte caps), and a failure to read or evaluate metrics still reconciles, so drift
correction never stops because of what a pod serves.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from magnitude.operator import naming as n
from magnitude.operator.apply import ApiError, Kube
from magnitude.operator.autoscaler import Decision, decide, hold
from magnitude.operator.desired import Owner, desired_replicas
from magnitude.operator.engine_client import set_shedding
from magnitude.operator.quantization import PodReport
from magnitude.operator.reconcile import SpecInvalid, operator_key, parse_spec, parse_status, reconcile
from magnitude.operator.scrape import PodInfo, Scraper, pod_url
from magnitude.operator.status import memory_from_status

log = logging.getLogger(__name__)
SYNC_SECONDS_ENV = "MAGNITUDE_OPERATOR_SYNC_SECONDS"
DEFAULT_SYNC_SECONDS = 10.0

Key = tuple[str, str]  # (namespace, name)
# The ticks' blocking API calls run here, not in asyncio's default executor (min(32, CPUs + 4)
# threads: 6 on a 2-CPU node), so a few services stuck in slow calls (a slow admission webhook in
# their namespace) cannot queue every other service's calls behind theirs. Each service has at
# most one tick, so one thread, in flight; threads start only when needed.
TICK_THREADS = 64
_POOL = ThreadPoolExecutor(max_workers=TICK_THREADS, thread_name_prefix="magnitude-tick")


async def _blocking(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))


@dataclass
class Entry:
    body: dict[str, Any]
    lock: threading.Lock = field(default_factory=threading.Lock)
    scraper: Scraper = field(default_factory=Scraper)


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


def _unix(stamp: Any) -> float | None:
    """An RFC 3339 time from the API (`2024-05-01T10:00:00Z`) as Unix seconds; None if it is not one."""
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def pod_infos(pods: list[dict[str, Any]]) -> list[PodInfo]:
    """Pods that count: terminating ones are already leaving and carry no capacity. A not-ready pod
    has been so since its Ready condition last flipped (the kubelet's time), else since it was
    created: the autoscaler stops waiting for it past the load timeout."""
    out = []
    for p in pods:
        meta, status = p.get("metadata", {}), p.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        cond = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
        ready = cond.get("status") == "True"
        since = None if ready else (_unix(cond.get("lastTransitionTime")) or _unix(meta.get("creationTimestamp")))
        out.append(PodInfo(name=meta["name"], uid=meta.get("uid", meta["name"]), ip=status.get("podIP"), ready=ready,
                           not_ready_since=since))
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
    pods = pod_infos(await _blocking(kube.list_pods, namespace, n.selector_string(name)))
    prev = parse_status(body)
    current, memory = desired_replicas(spec, prev), memory_from_status(prev)
    decision: Decision
    reports: tuple[PodReport, ...] | None = None
    try:
        # Ready pods' /readyz too: it carries what status shows (the scheduler's figures, derived
        # or set; the evaluation record of quantized weights; the commit SHA of an hf:// source).
        loads = await entry.scraper.scrape(client, pods, namespace, records=True)
        reports = entry.scraper.reports
        decision = decide(spec, current, loads, memory, now=time.time())
    except Exception as e:  # noqa: BLE001 - whatever a pod served, the reconcile below must still run
        log.exception("%s/%s: could not evaluate metrics", namespace, name)
        decision = hold(spec, current, memory, f"metrics could not be evaluated: {type(e).__name__}: {e}")

    def locked() -> None:
        with entry.lock:
            reconcile(kube, body, decision, reports)

    await _blocking(locked)
    want = frozenset(decision.shed_classes)
    stale = shed_stale(pods, entry.scraper.shed_reported, want)
    if not stale:
        return
    token = Owner.from_body(body, operator_key()).token  # derived: no Secret to read back
    for p in stale:
        url = pod_url(p, namespace)
        if url is None:
            continue
        if not await set_shedding(client, url, token, decision.shed_classes):
            log.warning("%s/%s: pod %s did not accept shedding %s", namespace, name, p.name, decision.shed_classes)


async def _tick_logged(kube: Kube, key: Key, entry: Entry, client: httpx.AsyncClient) -> None:
    try:
        await tick(kube, entry, client)
    except ApiError as e:
        log.warning("%s/%s: tick failed: %s", *key, e)
    except Exception:  # noqa: BLE001 - one service's failure must not end the loop for the others
        log.exception("%s/%s: tick crashed", *key)


async def run(kube: Kube, registry: Registry, stop: asyncio.Event | None = None) -> None:
    """Tick every ModelService each sync period until `stop` is set (or the task is cancelled)."""
    period = sync_seconds()
    running: dict[Key, asyncio.Task[None]] = {}
    async with httpx.AsyncClient() as client:
        try:
            while stop is None or not stop.is_set():
                started = time.monotonic()
                for key, entry in registry.items():
                    busy = running.get(key)
                    if busy is not None and not busy.done():
                        log.warning("%s/%s: previous tick still running; skipping this period", *key)
                        continue
                    running[key] = asyncio.create_task(_tick_logged(kube, key, entry, client), name=f"tick {key}")
                running = {k: t for k, t in running.items() if not t.done()}
                await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))
        finally:
            for task in running.values():
                task.cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)
