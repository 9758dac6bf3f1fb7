"""Scraping: the operator parses what the engine's own metrics adapter exposes."""

from __future__ import annotations

import asyncio
import math
import re

import httpx
import pytest
from prometheus_client import CollectorRegistry

from magnitude.operator import scrape
from magnitude.operator.autoscaler import aggregate
from magnitude.server.engine_loop import StepStats
from magnitude.server.metrics import EngineMetrics, RequestRecord


def engine_text(metrics: EngineMetrics) -> str:
    return metrics.exposition()[0].decode()


def engine(running: int, waiting: int, used: int, total: int = 100) -> EngineMetrics:
    m = EngineMetrics(registry=CollectorRegistry(), tenant_labels=["t1"])
    m.set_gauges(StepStats(t=0.0, duration_s=0.01, running=running, waiting=waiting, kv_used_blocks=used,
                           kv_total_blocks=total))
    return m


def queue(m: EngineMetrics, seconds: float, cls: str = "standard", tenant: str = "t1") -> None:
    m.observe_queue_time(cls, tenant, seconds)
    m.observe_request(RequestRecord(priority_class=cls, tenant=tenant, status="finished", arrival=0.0,
                                    admitted=seconds, first_token=seconds + 0.1, finished=seconds + 0.2))


def test_parse_reads_the_engine_series_summed_over_labels() -> None:
    m = engine(running=3, waiting=5, used=40)
    queue(m, 0.3, "interactive")
    queue(m, 4.0, "batch", tenant="someone-else")
    parsed = scrape.parse(engine_text(m))
    assert parsed.kv_usage == pytest.approx(0.4)
    assert (parsed.running, parsed.waiting) == (3, 5)
    assert parsed.queue_cumulative[math.inf] == 2
    assert parsed.queue_cumulative[0.5] == 1 and parsed.queue_cumulative[5.0] == 2
    assert parsed.shed_classes == frozenset()
    m.set_shedding(["batch"])
    assert scrape.parse(engine_text(m)).shed_classes == {"batch"}


def test_bucket_delta_is_per_interval_and_survives_restarts() -> None:
    prev = {0.5: 1.0, 5.0: 2.0, math.inf: 2.0}
    cur = {0.5: 1.0, 5.0: 5.0, math.inf: 6.0}
    assert scrape.bucket_delta(prev, cur) == ((0.5, 0.0), (5.0, 3.0), (math.inf, 1.0))
    assert scrape.bucket_delta(None, cur) == ()  # first sight: no interval yet
    assert scrape.bucket_delta(cur, prev) == ()  # counter reset (engine restarted)


def test_scraper_reports_only_new_queue_observations_and_staleness() -> None:
    asyncio.run(_scraper_scenario())


async def _scraper_scenario() -> None:
    engines = {"10.0.0.1": engine(running=2, waiting=0, used=10), "10.0.0.2": engine(running=4, waiting=6, used=90)}
    down: set[str] = set()

    def handler(request: httpx.Request) -> httpx.Response:  # the pod network, served by real engine metrics
        host = request.url.host
        if host in down:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, text=engine_text(engines[host]))

    clock = [100.0]
    pods = [scrape.PodInfo("a", "ua", "10.0.0.1", True), scrape.PodInfo("b", "ub", "10.0.0.2", True),
            scrape.PodInfo("c", "uc", None, False)]
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        s = scrape.Scraper(clock=lambda: clock[0])
        queue(engines["10.0.0.2"], 9.0)  # before the first scrape: history, not this interval
        first = await s.scrape(client, pods, "ml")
        assert [p.queue_buckets for p in first[:2]] == [(), ()]
        for _ in range(9):
            queue(engines["10.0.0.2"], 3.0)
        queue(engines["10.0.0.1"], 0.02)
        clock[0] = 110.0
        second = await s.scrape(client, pods, "ml")
        load = aggregate(second, max_age=30)
        assert load.fresh_pods == 2 and load.kv_usage == pytest.approx(0.5)
        assert load.waiting == 6 and load.running == 6
        assert 2.5 <= load.queue_time_p90 <= 5.0  # the 9 s from before the window is not counted
        assert second[2].ready is False and second[2].kv_usage is None
        down.add("10.0.0.2")
        clock[0] = 150.0
        third = await s.scrape(client, pods, "ml")
        assert third[1].age == pytest.approx(40.0)  # last good scrape, now stale
        assert aggregate(third, max_age=30).fresh_pods == 1


# ---- garbage from a pod: "metrics unavailable" for that pod, with the reason ---------------------

GOOD = engine_text(engine(running=1, waiting=0, used=10))


@pytest.mark.parametrize("garbage, why", [
    ("# TYPE magnitude_queue_time_seconds histogram\nmagnitude_queue_time_seconds_bucket 3\n", "without le"),
    ('# TYPE magnitude_queue_time_seconds histogram\nmagnitude_queue_time_seconds_bucket{le="soon"} 3\n',
     "le"),
    ('# TYPE magnitude_queue_time_seconds histogram\nmagnitude_queue_time_seconds_bucket{le="NaN"} 3\n', "le"),
    ("# TYPE magnitude_kv_cache_usage_ratio gauge\nmagnitude_kv_cache_usage_ratio NaN\n", "non-finite"),
    ("# TYPE magnitude_kv_cache_usage_ratio gauge\nmagnitude_kv_cache_usage_ratio +Inf\n", "non-finite"),
    ("# TYPE magnitude_kv_cache_usage_ratio gauge\nmagnitude_kv_cache_usage_ratio 7\n", "outside [0, 1]"),
    ("# TYPE magnitude_requests_waiting gauge\nmagnitude_requests_waiting -3\n", "negative"),
    ("# TYPE magnitude_requests_running gauge\nmagnitude_requests_running 1e400\n", "non-finite"),
    ('# TYPE magnitude_queue_time_seconds histogram\nmagnitude_queue_time_seconds_bucket{le="1.0"} 5\n'
     'magnitude_queue_time_seconds_bucket{le="+Inf"} 2\n', "cumulative"),
    ("magnitude_kv_cache_usage_ratio{{{ 0.5\n", "unparseable"),
])
def test_parse_rejects_malformed_or_non_finite_samples_by_name(garbage: str, why: str) -> None:
    with pytest.raises(scrape.MetricsRejected, match=re.escape(why)):
        scrape.parse(GOOD + garbage)


def test_a_pod_serving_garbage_has_no_metrics_and_says_why() -> None:
    """Today a bucket without `le` raises KeyError out of the scrape: the whole tick dies, every tick."""
    texts = {"10.0.0.1": GOOD,
             "10.0.0.2": GOOD + "# TYPE magnitude_queue_time_seconds histogram\nmagnitude_queue_time_seconds_bucket 1\n"}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=texts[request.url.host])

    async def go() -> list[scrape.PodLoad]:
        pods = [scrape.PodInfo("a", "ua", "10.0.0.1", True), scrape.PodInfo("b", "ub", "10.0.0.2", True)]
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            s = scrape.Scraper(clock=lambda: 5.0)
            await s.scrape(client, pods, "ml")
            texts["10.0.0.1"] = GOOD.replace("magnitude_kv_cache_usage_ratio 0.1", "magnitude_kv_cache_usage_ratio NaN")
            return await s.scrape(client, pods, "ml")
    a_, b_ = asyncio.run(go())
    assert b_.kv_usage is None and "without le" in (b_.problem or "")
    assert a_.kv_usage is None and "non-finite" in (a_.problem or "")  # its earlier good scrape no longer counts
    assert aggregate([a_, b_], max_age=30).fresh_pods == 0
