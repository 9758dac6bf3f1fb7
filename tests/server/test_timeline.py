"""Request timelines, timing breakdown and the decision log (server/timeline.py).

Unit tests drive `RequestLog` with scheduler events on a virtual clock (exact numbers); the HTTP
tests go through real uvicorn against the simulated runner and the real scheduler, and check
shapes, order and that the timing parts add up to e2e (same clock, so only rounding separates
them: no wall-clock thresholds).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from magnitude.engine.events import SchedulerEvent
from magnitude.engine.output import RequestUpdate, ScheduledSeq, StepPlan
from magnitude.engine.request import RequestStatus
from magnitude.engine.sampling import SamplingParams
from magnitude.server.app import ServerSettings
from magnitude.server.timeline import MAX_REASON_LABELS, RequestLog

from .conftest import RunningServer, serve, sim_config, simulated

PARTS = ("queue_time_ms", "loading_ms", "preparation_ms", "prefill_ms", "decode_ms", "preempted_ms")
ADMIN = {"Authorization": "Bearer adm"}


def assert_reconciles(timing: dict[str, Any]) -> None:
    """The parts are differences of one clock's timestamps over disjoint intervals covering
    arrival..end, each rounded to 0.001 ms: the sum is e2e within that rounding."""
    total = sum(timing[k] or 0.0 for k in PARTS)
    assert abs(total - timing["e2e_ms"]) <= 0.001 * (len(PARTS) + 1), (total, timing)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def chunk(rid: str, start: int, n: int, outputs: int = 0, sample: bool = False) -> ScheduledSeq:
    """`sample`: the chunk reaches the end of the request's tokens (the runner samples after it)."""
    return ScheduledSeq(rid, [0] * n, start, [], sample, SamplingParams(max_tokens=8), outputs)


def update(rid: str, tokens: list[int]) -> RequestUpdate:
    return RequestUpdate(rid, tokens, False, RequestStatus.RUNNING)


# -- RequestLog on a virtual clock ---------------------------------------------------------------
def test_timeline_of_a_preempted_request_orders_events_and_adds_up() -> None:
    clock = Clock()
    rl = RequestLog(clock)
    rl.open("cmpl-a", arrival=100.0, enqueued=100.5, prompt_tokens=40, priority_class="batch", tenant="t", client_id="mine")
    rl.queued("cmpl-a", 100.5, 0)
    ev = lambda t, kind, reason, **d: SchedulerEvent(t, kind, "cmpl-a", reason, d)  # noqa: E731
    # step 1 (101 -> 101.2): admitted with 16 prefix-cached tokens, first prompt chunk
    rl.observe_step(101.0, 101.2, StepPlan(1, [chunk("cmpl-a", 16, 16)]), [ev(101.0, "admit", "scheduled", cached_tokens=16)], [])
    # step 2 (101.2 -> 101.5): last chunk, first token
    rl.observe_step(101.2, 101.5, StepPlan(2, [chunk("cmpl-a", 32, 8, sample=True)]), [], [update("cmpl-a", [7])])
    # step 5 at 102.0: preempted (recompute); deferred; back at 104.0, recomputing 41 tokens
    rl.observe_step(102.0, 102.0, None, [ev(102.0, "preempt", "priority", mode="recompute")], [])
    rl.observe_step(103.0, 103.0, None, [ev(103.0, "defer", "kv_blocks")], [])
    rl.observe_step(104.0, 104.3, StepPlan(9, [chunk("cmpl-a", 0, 41, outputs=1, sample=True)]),
                    [ev(104.0, "admit", "resumed", cached_tokens=0)], [update("cmpl-a", [8])])
    rl.observe_step(105.0, 106.0, None, [ev(106.0, "finish", "length")], [])
    timing = rl.close("cmpl-a", "finished", 106.0, [101.5, 104.3, 106.0])

    assert timing == {
        "queue_time_ms": 500.0, "ttft_ms": 1500.0, "mean_itl_ms": 2250.0, "max_itl_ms": 2800.0, "e2e_ms": 6000.0, "loading_ms": 0.0,
        "preparation_ms": 500.0, "prefill_ms": 500.0, "decode_ms": 2500.0, "preempted_ms": 2000.0,
        "cached_prompt_tokens": 16, "spec_acceptance": None, "max_burst_tokens": 1,
    }
    assert_reconciles(timing)
    doc = rl.find("mine")
    assert doc is not None and doc == rl.find("cmpl-a") == rl.find("chatcmpl-a")
    assert doc["status"] == "finished" and doc["timing"] == timing
    kinds = [(e["kind"], e["reason"]) for e in doc["events"]]
    assert kinds == [
        ("arrival", "http"), ("preparation", "tokenized"), ("queued", "accepted"),
        ("admit", "scheduled"), ("prefix_cache_hit", "scheduled"), ("prefill_chunk", "prompt"),
        ("prefill_chunk", "prompt"), ("first_token", "sampled"),
        ("preempt", "priority"), ("defer", "kv_blocks"), ("admit", "resumed"), ("prefill_chunk", "recompute"),
        ("finish", "length"),
    ]
    by_kind = {e["kind"]: e for e in doc["events"]}
    assert by_kind["prefix_cache_hit"]["tokens"] == 16
    assert [(e["tokens"], e["start"], e["step"]) for e in doc["events"] if e["kind"] == "prefill_chunk"] == [
        (16, 16, 1), (8, 32, 2), (41, 0, 9)]
    assert by_kind["preempt"]["mode"] == "recompute"
    resumed = next(e for e in doc["events"] if e["reason"] == "resumed")
    assert resumed["lost_ms"] == 2000.0
    assert [e["t"] for e in doc["events"]] == sorted(e["t"] for e in doc["events"])  # seconds since arrival


def test_live_and_cancelled_while_preempted_still_add_up() -> None:
    clock = Clock()
    rl = RequestLog(clock)
    rl.open("r", arrival=100.0, enqueued=100.0, prompt_tokens=4, priority_class="c", tenant="t", loading_s=0.0)
    rl.observe_step(100.0, 100.1, StepPlan(1, [chunk("r", 0, 4, sample=True)]),
                    [SchedulerEvent(100.0, "admit", "r", "scheduled", {"cached_tokens": 0})], [update("r", [1])])
    rl.observe_step(101.0, 101.0, None, [SchedulerEvent(101.0, "preempt", "r", "kv_blocks", {"mode": "swap"}),
                                         SchedulerEvent(101.0, "swap_out", "r", "kv_blocks", {"blocks": 2})], [])
    clock.t = 103.0
    live = rl.find("r")
    assert live is not None and live["status"] == "preempted"
    assert live["timing"]["preempted_ms"] == 2000.0 and live["timing"]["e2e_ms"] == 3000.0
    assert_reconciles(live["timing"])
    timing = rl.close("r", "cancelled", 104.0, [100.1])
    assert timing["preempted_ms"] == 3000.0 and timing["decode_ms"] == 900.0
    assert_reconciles(timing)


def test_rings_are_bounded_and_aliases_leave_with_their_request() -> None:
    rl = RequestLog(Clock(), max_requests=3, max_decisions=5, max_events_per_request=8)
    for i in range(5):
        rl.open(f"r{i}", arrival=0.0, enqueued=0.0, prompt_tokens=1, priority_class="c", tenant="t", client_id=f"c{i}")
        rl.close(f"r{i}", "finished", 1.0, [])
    assert len(rl) == 3
    assert rl.find("r0") is None and rl.find("c1") is None and rl.find("c4") is not None
    assert len(rl._aliases) == 3  # noqa: SLF001 - the alias map is bounded with the ring
    # a request that keeps being deferred and preempted keeps only max_events_per_request entries
    rl.open("busy", arrival=0.0, enqueued=0.0, prompt_tokens=1, priority_class="c", tenant="t")
    for i in range(20):
        rl.observe_step(float(i), float(i), None, [SchedulerEvent(float(i), "defer", "busy", f"why{i % 2}")], [])
    doc = rl.find("busy")
    assert doc is not None and len(doc["events"]) == 8 and doc["dropped_events"] == 20 + 2 - 8
    # the decision log keeps the last 5, says how many a slow reader missed, and pages with `next`
    page = rl.decisions(since=0, limit=2)
    assert [d["seq"] for d in page["decisions"]] == [15, 16] and page["dropped"] == 15 and page["next"] == 17
    page = rl.decisions(since=page["next"])
    assert [d["seq"] for d in page["decisions"]] == [17, 18, 19] and page["next"] == 20 and page["dropped"] == 0
    assert rl.decisions(since=20) == {"decisions": [], "next": 20, "dropped": 0}
    assert rl.decisions(since=999)["next"] == 20  # a reader ahead of this process (a restart) starts over


def test_decision_counts_have_bounded_reason_labels() -> None:
    rl = RequestLog(Clock())
    events = [SchedulerEvent(0.0, "finish", "", f"error: runner error {i}") for i in range(3)]
    events += [SchedulerEvent(0.0, "reject", "", f"too_long:{i}>10") for i in range(3)]
    events += [SchedulerEvent(0.0, "defer", "", f"novel{i}") for i in range(MAX_REASON_LABELS + 10)]
    rl.observe_step(0.0, 0.0, None, events, [])
    counts = rl.decision_counts()
    assert counts[("finish", "error")] == 3 and counts[("reject", "too_long")] == 3
    assert len(counts) == MAX_REASON_LABELS + 1 and counts[("defer", "other")] == 12


# -- over HTTP, simulated runner -------------------------------------------------------------------
def chat(content: str = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": "simulated", "messages": [{"role": "user", "content": content}], "max_tokens": 6, **kw}


def debug(s: RunningServer, some_id: str) -> dict[str, Any]:
    r = httpx.get(f"{s.url}/debug/requests/{some_id}", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def test_decisions_count_from_the_engines_origin_on_a_shared_clock() -> None:
    """The decision log's `t`, the recorded trace's arrivals and the served margin's history share
    one origin when the request log runs on the engine's clock (a replay sets them side by side)."""
    from magnitude.server.async_engine import AsyncEngine
    from magnitude.server.metrics import EngineMetrics

    config = sim_config()
    clock = Clock()
    log = RequestLog(clock)
    clock.t = 107.5  # the engine is made later than the log (serve builds the log first)
    engine = AsyncEngine(config, simulated(config), EngineMetrics(), request_log=log, clock=clock)
    assert engine.origin == log.origin == 100.0
    other = AsyncEngine(config, simulated(config), EngineMetrics(), request_log=RequestLog(Clock()), clock=time.monotonic)
    assert other.origin != 100.0  # another clock: the engine keeps its own


def test_timeline_over_http_found_by_every_id_and_timing_adds_up() -> None:
    config = sim_config(scheduler__prefill_chunk_size=32, scheduler__token_budget=64)
    with serve(simulated(config), config, ServerSettings(admin_token="adm")) as s:
        r = httpx.post(s.v1 + "/chat/completions", json=chat("x" * 100), headers={"X-Request-Id": "client-42"})
        assert r.status_code == 200
        body = r.json()
        timing = body["timing"]
        for key in ("preparation_ms", "prefill_ms", "decode_ms", "preempted_ms", "cached_prompt_tokens"):
            assert timing[key] is not None, key
        assert timing["preempted_ms"] == 0.0 and timing["cached_prompt_tokens"] == 0
        assert timing["ttft_ms"] >= timing["preparation_ms"] + timing["queue_time_ms"]  # arrival is the HTTP arrival
        assert_reconciles(timing)

        doc = debug(s, body["id"])  # chatcmpl-...
        assert doc == debug(s, r.headers["X-Request-Id"]) == debug(s, "client-42")
        assert doc["id"] == r.headers["X-Request-Id"] and doc["client_request_id"] == "client-42"
        assert doc["timing"] == timing
        kinds = [e["kind"] for e in doc["events"]]
        assert kinds[:4] == ["arrival", "preparation", "queued", "admit"]
        chunks = [e for e in doc["events"] if e["kind"] == "prefill_chunk"]
        assert sum(c["tokens"] for c in chunks) == body["usage"]["prompt_tokens"] and len(chunks) > 1
        assert all(c["tokens"] <= 32 for c in chunks) and [c["step"] for c in chunks] == sorted({c["step"] for c in chunks})
        assert kinds.index("first_token") > kinds.index("prefill_chunk")
        assert "finish" in kinds and kinds.index("finish") > kinds.index("first_token")

        # the same story in metrics: decisions by kind and reason, phase and length histograms
        assert s.metric("magnitude_decisions_total", kind="admit", reason="scheduled") == 1
        assert s.metric("magnitude_decisions_total", kind="finish", reason="length") == 1
        for name in ("request_preparation_seconds", "request_prefill_seconds", "request_prompt_tokens",
                     "request_generation_tokens"):
            assert s.metric(f"magnitude_{name}_count", priority_class="standard") == 1, name
        assert s.metric("magnitude_request_generation_tokens_sum") == 6
        assert s.metric("magnitude_e2e_request_latency_seconds_bucket", le="7200.0") == 1  # hours-long buckets

        assert httpx.get(f"{s.url}/debug/requests/{body['id']}").status_code == 401
        r = httpx.get(f"{s.url}/debug/requests/nope", headers=ADMIN)
        assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
        r = httpx.post(s.v1 + "/chat/completions", json=chat(), headers={"X-Request-Id": "x" * 129})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"


def test_debug_endpoints_are_off_without_an_admin_token(sim_server: RunningServer) -> None:
    assert httpx.get(sim_server.url + "/debug/decisions").status_code == 403
    assert httpx.get(sim_server.url + "/debug/requests/x").status_code == 403


def test_a_429_is_explained_by_its_timeline_and_the_decision_log() -> None:
    config = sim_config()
    with serve(simulated(config), config, ServerSettings(admin_token="adm")) as s:
        start = httpx.get(s.url + "/debug/decisions", headers=ADMIN).json()["next"]
        assert httpx.post(s.url + "/admin/shedding", json={"classes": ["batch"]}, headers=ADMIN).status_code == 200
        r = httpx.post(s.v1 + "/chat/completions", json=chat(priority_class="batch"), headers={"X-Request-Id": "shed-me"})
        assert r.status_code == 429
        doc = debug(s, "shed-me")
        assert doc["status"] == "rejected"
        assert [(e["kind"], e["reason"]) for e in doc["events"]][-1] == ("reject", "shedding")
        assert_reconciles(doc["timing"])
        page = httpx.get(s.url + "/debug/decisions", params={"since": start}, headers=ADMIN).json()
        got = [(d["kind"], d["reason"], d["request"]) for d in page["decisions"]]
        assert got == [("shed", "admin", None), ("reject", "shedding", doc["id"])]
        assert page["decisions"][0]["classes"] == ["batch"]
        again = httpx.get(s.url + "/debug/decisions", params={"since": page["next"]}, headers=ADMIN).json()
        assert again["decisions"] == [] and again["next"] == page["next"]
        assert s.metric("magnitude_decisions_total", kind="reject", reason="shedding") == 1
        assert s.metric("magnitude_decisions_total", kind="shed", reason="admin") == 1
        assert httpx.get(s.url + "/debug/decisions", params={"since": -1}, headers=ADMIN).status_code == 400


def test_a_preempted_request_shows_it_and_its_times_add_up() -> None:
    # 12 blocks of 16 tokens: a long batch generation holds most of them when an interactive request
    # with a long prompt arrives; the scheduler preempts the batch request for it.
    config = sim_config(kvCache__numBlocks=12, scheduler__preemption_mode="recompute")
    with serve(simulated(config), config, ServerSettings(admin_token="adm")) as s:
        result: dict[str, Any] = {}
        generating = threading.Event()

        def batch() -> None:
            body = chat("b", max_tokens=150, ignore_eos=True, priority_class="batch", stream=True,
                        stream_options={"include_progress": True})
            with httpx.stream("POST", s.v1 + "/chat/completions", json=body, headers={"X-Request-Id": "victim"}, timeout=30) as r:
                for line in r.iter_lines():
                    if '"phase":"generating"' in line:
                        generating.set()
                    if line.startswith("data: {") and '"timing"' in line:
                        result["timing"] = json.loads(line[6:])["timing"]

        t = threading.Thread(target=batch)
        t.start()
        assert generating.wait(30)
        while debug(s, "victim")["timing"]["decode_ms"] < 20:  # well into its blocks
            time.sleep(0.01)
        r = httpx.post(s.v1 + "/chat/completions", json=chat("y" * 80, priority_class="interactive", max_tokens=40, ignore_eos=True))
        assert r.status_code == 200
        t.join(30)
        doc = debug(s, "victim")
        kinds = [(e["kind"], e["reason"]) for e in doc["events"] if e["kind"] != "prefill_chunk"]
        # for the newcomer's admission (priority) or for its growth (kv_blocks): the timing decides which
        preempt = next(k for k in kinds if k[0] == "preempt")
        assert preempt[1] in ("priority", "kv_blocks") and ("admit", "resumed") in kinds, kinds
        assert kinds.index(("admit", "resumed")) > kinds.index(preempt) > kinds.index(("first_token", "sampled"))
        resumed = next(e for e in doc["events"] if e["reason"] == "resumed")
        assert resumed["lost_ms"] > 0
        assert any(e["kind"] == "prefill_chunk" and e["reason"] == "recompute" for e in doc["events"])
        timing = result["timing"]
        assert timing == doc["timing"] and timing["preempted_ms"] >= resumed["lost_ms"]
        assert_reconciles(timing)
