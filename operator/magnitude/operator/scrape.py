"""Scraping engine pods' /metrics into `autoscaler.PodLoad`s.

`parse()` reads the Prometheus text format with prometheus_client's parser and sums series over
their labels; `Scraper` keeps each pod's previous queue-time histogram so the autoscaler sees only
the observations since the last tick (a cumulative histogram would never let a service scale down),
and likewise the engine's decision counters (`magnitude_decisions_total{kind,reason}`), whose top
reasons the Scaling and Shedding conditions cite.

Pods are not trusted to behave. A scrape has one deadline and a byte cap for the whole exchange
(`podhttp`), and `parse()` refuses a sample it cannot use (a bucket without a numeric `le`, a
NaN, an infinity, a negative count, a KV ratio outside [0, 1], buckets that are not cumulative)
with `MetricsRejected`. Either way the pod has no metrics this tick and its `PodLoad.problem`
says why, so the policy holds and the Scaling condition names the pod; nothing escapes the tick.

`/readyz` is read too, from every pod with an address, ready or not: a ready pod's scheduler figures
(status.scheduler); a not-ready pod's phase
(`quantization_rejected`, `failed`, `dead`: it will not become ready by waiting) tells the
autoscaler to stop counting it as capacity on its way, and a quantized service's pods report
their quantization evaluation record there (`quantization.PodReport`), which becomes the
QuantizationValidated condition. Same deadline and byte cap as a scrape.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from magnitude.operator import naming as n
from magnitude.operator.autoscaler import PodLoad
from magnitude.operator.podhttp import PodHttpError, request
from magnitude.operator.quantization import PodReport, parse_record

# The engine series the operator reads (DESIGN §3 Metrics).
KV_USAGE = "magnitude_kv_cache_usage_ratio"
WAITING = "magnitude_requests_waiting"
RUNNING = "magnitude_requests_running"
QUEUE_TIME = "magnitude_queue_time_seconds"
SHED_CLASS = "magnitude_admission_shed_class"
DECISIONS = "magnitude_decisions"  # the family of magnitude_decisions_total{kind,reason}
# A counter's samples arrive under the family without `_total`, or (untyped) as their own family.
DECISION_FAMILIES = (DECISIONS, DECISIONS + "_total")
READ_METRICS = (KV_USAGE, WAITING, RUNNING, QUEUE_TIME, SHED_CLASS, *DECISION_FAMILIES)
# The engine bounds its reason labels (128 pairs); a pod sending more is not trusted with them.
MAX_DECISION_SERIES = 512

# Where a pod's engine answers. The e2e harness may point this elsewhere (kwok pods run no process).
URL_TEMPLATE_ENV = "MAGNITUDE_OPERATOR_POD_URL"
DEFAULT_URL_TEMPLATE = "http://{ip}:{port}"
# One deadline for the whole scrape (connect, headers, body), and a cap on the body: an engine's
# /metrics is tens of kB (tenant labels are bounded), so 4 MiB is generous and still cheap.
SCRAPE_DEADLINE_SECONDS = 2.0
SCRAPE_MAX_BYTES = 4 << 20
# /readyz is a small JSON document (the evaluation record lists a handful of probes).
READYZ_MAX_BYTES = 256 << 10


class MetricsRejected(ValueError):
    """A pod's /metrics that cannot be trusted; the message names the series and why."""


@dataclass(frozen=True)
class PodMetrics:
    kv_usage: float | None = None
    waiting: float = 0.0
    running: float = 0.0
    queue_cumulative: dict[float, float] = field(default_factory=dict)  # le -> cumulative count (all labels)
    shed_classes: frozenset[str] | None = None  # None: the engine does not export the series
    decisions: dict[tuple[str, str], float] = field(default_factory=dict)  # (kind, reason) -> cumulative count


@dataclass(frozen=True)
class PodInfo:
    """The parts of a pod the scraper needs (from the API module's pod listing)."""

    name: str
    uid: str
    ip: str | None
    ready: bool
    not_ready_since: float | None = None  # Unix seconds the pod last became (or was created) not ready


def _number(series: str, value: float) -> float:
    """A sample value the policy can use: finite and not negative (every series read counts
    something or is a ratio)."""
    if not math.isfinite(value):
        raise MetricsRejected(f"{series}: non-finite value {value}")
    if value < 0:
        raise MetricsRejected(f"{series}: negative value {value:g}")
    return value


def _bound(labels: dict[str, str]) -> float:
    """A histogram bucket's upper bound (`le`): a number or +Inf."""
    if "le" not in labels:
        raise MetricsRejected(f"{QUEUE_TIME}_bucket without le")
    try:
        le = float(labels["le"])
    except ValueError:
        raise MetricsRejected(f"{QUEUE_TIME}_bucket with le={labels['le']!r}, not a number") from None
    if math.isnan(le):
        raise MetricsRejected(f"{QUEUE_TIME}_bucket with le=NaN")
    return le


def parse(text: str) -> PodMetrics:
    """Sum each series over its labels; histogram buckets keyed by their upper bound. Raises
    MetricsRejected for anything the policy could not use (module docstring)."""
    gauges: dict[str, float] = {}
    buckets: dict[float, float] = {}
    shed: set[str] | None = None
    decisions: dict[tuple[str, str], float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # noqa: BLE001 - the parser raises ValueError, IndexError, ... on garbage
        raise MetricsRejected(f"unparseable metrics text: {type(e).__name__}: {e}") from None
    for family in families:
        if family.name not in READ_METRICS:
            continue
        if family.name == SHED_CLASS:
            shed = shed or set()
            shed |= {s.labels.get("priority_class", "") for s in family.samples if _number(SHED_CLASS, s.value) >= 0.5}
            continue
        if family.name in DECISION_FAMILIES:
            for sample in family.samples:
                if sample.name == DECISIONS + "_total":
                    key = (sample.labels.get("kind", "")[:64], sample.labels.get("reason", "")[:128])
                    decisions[key] = decisions.get(key, 0.0) + _number(sample.name, sample.value)
            if len(decisions) > MAX_DECISION_SERIES:
                raise MetricsRejected(f"{DECISIONS}_total: {len(decisions)} series, over {MAX_DECISION_SERIES}")
            continue
        for sample in family.samples:
            if sample.name == QUEUE_TIME + "_bucket":
                le = _bound(sample.labels)
                buckets[le] = buckets.get(le, 0.0) + _number(sample.name, sample.value)
            elif sample.name == family.name:
                gauges[family.name] = gauges.get(family.name, 0.0) + _number(sample.name, sample.value)
    kv = gauges.get(KV_USAGE)
    if kv is not None and kv > 1.0:
        raise MetricsRejected(f"{KV_USAGE}: {kv:g} is outside [0, 1]")
    counts = [buckets[le] for le in sorted(buckets)]
    if any(later < earlier for earlier, later in zip(counts, counts[1:])):
        raise MetricsRejected(f"{QUEUE_TIME}: bucket counts are not cumulative")
    return PodMetrics(kv_usage=kv, waiting=gauges.get(WAITING, 0.0), running=gauges.get(RUNNING, 0.0),
                      queue_cumulative=buckets, shed_classes=None if shed is None else frozenset(shed),
                      decisions=decisions)


def counter_delta(prev: dict[tuple[str, str], float] | None,
                  cur: dict[tuple[str, str], float]) -> tuple[tuple[tuple[str, str], float], ...]:
    """What each counter gained between two snapshots (those that gained anything). With no previous
    snapshot, or after a reset (engine restart: some counter went down), nothing."""
    if prev is None or any(cur.get(k, 0.0) < v for k, v in prev.items()):
        return ()
    return tuple((k, v - prev.get(k, 0.0)) for k, v in cur.items() if v > prev.get(k, 0.0))


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
        self.reports: tuple[PodReport, ...] = ()  # the latest /readyz of each pod that answered one

    async def scrape(self, client: httpx.AsyncClient, pods: list[PodInfo], namespace: str,
                     records: bool = False) -> list[PodLoad]:
        """Fetch /metrics of every ready pod and /readyz of every not-ready one (of every pod with
        `records`: a quantized service's ready pods carry their evaluation record there too) over
        `client` (the loop's shared one: connections are reused). A pod that answers garbage loses
        its earlier metrics at once (they describe an engine that no longer reports sanely); one
        that does not answer keeps them until they are stale."""
        ready = [p for p in pods if p.ready]
        asked = [p for p in pods if records or not p.ready]
        got, answers = await asyncio.gather(
            asyncio.gather(*(fetch_metrics(client, pod_url(p, namespace)) for p in ready)),
            asyncio.gather(*(fetch_readiness(client, pod_url(p, namespace), p.name) for p in asked)))
        reports = {r.pod: r for r in answers if r is not None}
        self.reports = tuple(reports.values())
        now = self._clock()
        fresh: dict[str, tuple[PodMetrics, Any, Any]] = {}  # uid -> (metrics, queue buckets, decisions) since last
        problems: dict[str, str] = {}
        for pod, (text, problem) in zip(ready, got):
            if text is not None:
                try:
                    metrics = parse(text)
                except MetricsRejected as e:
                    problem = str(e)
                    self._last.pop(pod.uid, None)
                else:
                    prev = self._last.get(pod.uid)
                    fresh[pod.uid] = (metrics, bucket_delta(prev.metrics.queue_cumulative if prev else None,
                                                             metrics.queue_cumulative),
                                      counter_delta(prev.metrics.decisions if prev else None, metrics.decisions))
                    self._last[pod.uid] = _Seen(now, metrics)
            if problem is not None:
                problems[pod.uid] = problem
        alive = {p.uid for p in pods}
        self._last = {uid: s for uid, s in self._last.items() if uid in alive}
        self.shed_reported = {p.name: fresh[p.uid][0].shed_classes for p in ready if p.uid in fresh}
        loads: list[PodLoad] = []
        for p in pods:
            seen = self._last.get(p.uid)
            if not p.ready or seen is None:
                report = reports.get(p.name)
                loads.append(PodLoad(name=p.name, ready=p.ready, problem=problems.get(p.uid),
                                     phase=report.phase if report is not None else None,
                                     not_ready_since=None if p.ready else p.not_ready_since))
                continue
            metrics, delta, decided = fresh.get(p.uid, (seen.metrics, (), ()))
            loads.append(PodLoad(name=p.name, ready=True, age=now - seen.at, kv_usage=metrics.kv_usage,
                                 waiting=metrics.waiting, running=metrics.running, queue_buckets=delta,
                                 problem=problems.get(p.uid), decisions=decided))
        return loads


async def fetch_metrics(client: httpx.AsyncClient, url: str | None) -> tuple[str | None, str | None]:
    """(the /metrics text, None) or (None, why there is none)."""
    if url is None:
        return None, "no pod IP yet"
    try:
        status, body = await request(client, "GET", url + "/metrics", deadline=SCRAPE_DEADLINE_SECONDS,
                                     max_bytes=SCRAPE_MAX_BYTES)
    except PodHttpError as e:
        return None, f"scrape failed: {e}"
    if status != 200:
        return None, f"scrape answered HTTP {status}"
    return body.decode("utf-8", errors="replace"), None


async def fetch_readiness(client: httpx.AsyncClient, url: str | None, pod: str) -> PodReport | None:
    """What the pod's /readyz says (its phase when not ready, its quantization record), or None when
    it gives no usable answer: not up yet, too slow, too big, not JSON. Loading pods often refuse
    connections, so a failure here is normal and says nothing about the pod."""
    if url is None:
        return None
    try:
        status, body = await request(client, "GET", url + "/readyz", deadline=SCRAPE_DEADLINE_SECONDS,
                                     max_bytes=READYZ_MAX_BYTES)
        doc = json.loads(body)
    except (PodHttpError, ValueError):
        return None
    if not isinstance(doc, dict) or status not in (200, 503):
        return None
    phase = doc.get("phase") if status == 503 else None
    source, revision = doc.get("source"), doc.get("revision")
    done, total = (_count(doc.get(k)) if status == 503 else None for k in ("bytes_done", "bytes_total"))
    return PodReport(pod=pod, phase=phase[:64] if isinstance(phase, str) else None, bytes_done=done, bytes_total=total,
                     record=parse_record(doc.get("quantization")),
                     source=source[:1024] if isinstance(source, str) and status == 200 else None,
                     revision=revision[:256] if isinstance(revision, str) and status == 200 else None,
                     scheduler=_scheduler(doc.get("scheduler")) if status == 200 else None)


SCHEDULER_SOURCES = ("set", "derived", "static")


def _scheduler(value: Any) -> tuple[int, int, float | None, str] | None:
    """A ready pod's scheduler figures, or None unless every one is sane (positive integers, a
    positive finite target or null, a known source): a pod's garbage never reaches status."""
    if not isinstance(value, dict):
        return None
    budget, chunk, target, source = (value.get(k) for k in ("tokenBudget", "prefillChunkSize", "itlTargetMs", "source"))
    if _count(budget) in (None, 0) or _count(chunk) in (None, 0) or source not in SCHEDULER_SOURCES:
        return None
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not math.isfinite(target) or target <= 0):
        return None
    return budget, chunk, None if target is None else float(target), source


def _count(value: Any) -> int | None:
    """A byte count a pod reported, or None unless it is a non-negative integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
