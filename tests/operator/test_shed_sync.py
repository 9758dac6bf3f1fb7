"""Which pods the loop re-tells what to shed: those whose own per-class series differs from the
decision, or that export none. Nothing is remembered across ticks, so a restarted operator or a
restarted engine is handled by the next scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from magnitude.operator import scrape
from magnitude.operator.loop import shed_stale
from magnitude.operator.scrape import PodInfo
from magnitude.server.metrics import EngineMetrics

PODS = [PodInfo("a", "ua", "10.0.0.1", True), PodInfo("b", "ub", "10.0.0.2", True),
        PodInfo("c", "uc", "10.0.0.3", False), PodInfo("d", "ud", "10.0.0.4", True)]
BATCH = frozenset({"batch"})


def names(pods: list[PodInfo]) -> list[str]:
    return [p.name for p in pods]


def test_same_count_different_set_is_resent() -> None:
    reported = {"a": BATCH, "b": frozenset({"standard"}), "c": frozenset()}  # d not scraped; c not ready
    assert names(shed_stale(PODS, reported, BATCH)) == ["b"]


def test_restarts_unknown_and_steady_state() -> None:
    assert names(shed_stale(PODS, {"a": frozenset(), "b": BATCH}, BATCH)) == ["a"]  # a restarted: sheds nothing
    assert names(shed_stale(PODS, {"a": None}, frozenset())) == ["a"]  # no series: cannot tell, tell it
    assert shed_stale(PODS, {"a": frozenset(), "b": frozenset()}, frozenset()) == []
    assert shed_stale(PODS, {"a": BATCH, "b": BATCH}, BATCH) == []  # already so: not again


def test_the_engines_series_round_trips_through_the_scraper() -> None:
    m = EngineMetrics(registry=CollectorRegistry())

    def reported() -> frozenset[str] | None:
        return scrape.parse(m.exposition()[0].decode()).shed_classes

    assert reported() == frozenset()  # exported before any shedding: "nothing", not "unknown"
    m.set_shedding(["batch", "standard"])
    assert reported() == {"batch", "standard"}
    m.set_shedding(["batch"])
    assert reported() == BATCH
    m.set_shedding([])
    assert reported() == frozenset()
    assert scrape.parse("magnitude_requests_running 1\n").shed_classes is None
