"""Which pods the loop re-tells what to shed: by the set of classes, not just how many."""

from __future__ import annotations

from magnitude.operator.loop import shed_stale
from magnitude.operator.scrape import PodInfo

PODS = [PodInfo("a", "ua", "10.0.0.1", True), PodInfo("b", "ub", "10.0.0.2", True),
        PodInfo("c", "uc", "10.0.0.3", False), PodInfo("d", "ud", "10.0.0.4", True)]


def names(pods: list[PodInfo]) -> list[str]:
    return [p.name for p in pods]


def test_same_count_different_set_is_resent() -> None:
    sent = {"a": frozenset({"batch"}), "b": frozenset({"standard"})}
    reported = {"a": 1, "b": 1, "c": 0}  # d was not scraped this tick; c is not ready
    assert names(shed_stale(PODS, reported, sent, frozenset({"batch"}))) == ["b"]


def test_count_mismatch_unknown_and_restart() -> None:
    want = frozenset({"batch"})
    assert names(shed_stale(PODS, {"a": 0, "b": 1}, {"a": want}, want)) == ["a", "b"]  # a restarted; b never told
    assert names(shed_stale(PODS, {"a": None}, {}, frozenset())) == ["a"]  # no gauge: cannot tell
    assert shed_stale(PODS, {"a": 0, "b": 0}, {}, frozenset()) == []  # nothing shed, nothing wanted
    assert shed_stale(PODS, {"a": 1}, {"a": want}, want) == []  # told once, not again
