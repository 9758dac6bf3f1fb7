"""status.model: what the ready pods' /readyz says they serve (source and, for hf://, the commit
SHA the revision resolved to), the most common answer during a rollout, kept between ticks that
did not read the pods. The live version is e2e/test_hub_model.py."""

from __future__ import annotations

from magnitude.operator import quantization as q
from magnitude.operator import status as st
from magnitude.operator.spec import ModelStatus

SHA_A, SHA_B = "a" * 40, "b" * 40
NOW = "2026-01-01T00:00:00Z"


def obs(reports: tuple[q.PodReport, ...] | None) -> st.Observed:
    return st.Observed(deployment=None, desired_replicas=2, service_version="v", selector="s", pod_reports=reports)


def test_the_most_common_answer_of_the_pods_wins_and_is_kept_without_news() -> None:
    reports = (q.PodReport("p1", source="hf://org/tiny@main", revision=SHA_A),
               q.PodReport("p2", source="hf://org/tiny@main", revision=SHA_A),
               q.PodReport("p3", source="hf://org/tiny@v2", revision=SHA_B),
               q.PodReport("p4", phase="downloading"))
    first = st.build(None, 1, obs(reports), None, NOW)
    assert first.model == ModelStatus(source="hf://org/tiny@main", revision=SHA_A)
    assert first.to_document()["model"] == {"source": "hf://org/tiny@main", "revision": SHA_A}
    assert st.build(first, 1, obs(None), None, NOW).model == first.model  # a change handler's reconcile
    assert st.build(first, 1, obs((q.PodReport("p4", phase="loading"),)), None, NOW).model == first.model
    assert st.build(None, 1, obs(()), None, NOW).model is None


def test_readyz_answers_become_reports_and_the_ready_message_says_what_loading_pods_do() -> None:
    """fetch_readiness over /readyz bodies shaped as the engine's app.py writes them (a
    MockTransport stands in for the pod network; the live exchange is e2e/test_hub_model.py)."""
    import asyncio

    import httpx

    from magnitude.operator import scrape

    answers = {
        "10.0.0.1": (200, {"status": "ready", "model": "tiny", "source": "hf://org/tiny@v1", "revision": SHA_A}),
        "10.0.0.2": (503, {"status": "not_ready", "phase": "downloading", "progress": 0.25,
                           "bytes_done": 12_000_000, "bytes_total": 48_000_000, "source": "hf://org/tiny@v1"}),
        "10.0.0.3": (503, {"status": "not_ready", "phase": "converting", "bytes_done": -1, "bytes_total": True}),
    }

    def handler(request: httpx.Request) -> httpx.Response:
        status, body = answers[request.url.host]
        return httpx.Response(status, json=body)

    async def fetch() -> list[q.PodReport | None]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return list(await asyncio.gather(*(scrape.fetch_readiness(client, f"http://{ip}:8000", f"p{i}")
                                               for i, ip in enumerate(answers, 1))))

    ready, downloading, converting = asyncio.run(fetch())
    assert ready == q.PodReport("p1", source="hf://org/tiny@v1", revision=SHA_A)
    assert downloading == q.PodReport("p2", phase="downloading", bytes_done=12_000_000, bytes_total=48_000_000)
    assert converting == q.PodReport("p3", phase="converting")  # nonsense byte counts are dropped
    status = st.build(None, 1, st.Observed(deployment={"metadata": {"generation": 1}, "spec": {"replicas": 3},
                                                       "status": {"observedGeneration": 1, "replicas": 3,
                                                                  "readyReplicas": 1}},
                                           desired_replicas=3, service_version="v", selector="s",
                                           pod_reports=(ready, downloading, converting)), None, NOW)
    message = next(c.message for c in status.conditions if c.type == "Ready")
    assert message == "1/3 pods ready; pod p2 downloading 12.0/48.0 MB; pod p3 converting", message
    assert status.model == ModelStatus(source="hf://org/tiny@v1", revision=SHA_A)
