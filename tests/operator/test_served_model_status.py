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
