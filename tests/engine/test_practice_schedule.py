"""The practice schedule: A (0, 24, 4), B (0, 4, 8), high-priority C (1, 8, 4), D (2, 20, 2) as
(arrival, prompt, outputs); 16-token budget; 40 units of live state (block size 1, 40 blocks).
Run through the simulator (unit cost: every step lasts 1) under three policies and check what
each one shows, including when D is deferred or rejected and why."""

from __future__ import annotations

import pytest

from magnitude.policy.load import resolve_config
from magnitude.sim.cost import UnitCost
from magnitude.sim.report import build_report
from magnitude.sim.trace import TraceRecord

from magnitude.sim.simulate import simulate

BASE = ["scheduler.tokenBudget=16", "kvCache.blockSize=1", "kvCache.numBlocks=40"]
SAME_LEVEL = "scheduler.priorityClasses=[{name: interactive, priority: 1}, {name: standard, priority: 1}]"
FCFS = [SAME_LEVEL, "scheduler.agingSecondsPerLevel=null", "scheduler.tenantFairness=false"]
POLICIES = {
    "fcfs_no_chunking": BASE + FCFS + ["scheduler.prefillChunkSize=16"],
    "chunks_8": BASE + FCFS + ["scheduler.prefillChunkSize=8"],
    "priority_aging": BASE + ["scheduler.prefillChunkSize=8", "scheduler.agingSecondsPerLevel=4"],
}


def trace(d_deadline: float | None = None) -> list[TraceRecord]:
    return [
        TraceRecord(id="A", arrival=0, prompt_tokens=24, output_tokens=4, priority_class="standard"),
        TraceRecord(id="B", arrival=0, prompt_tokens=4, output_tokens=8, priority_class="standard"),
        TraceRecord(id="C", arrival=1, prompt_tokens=8, output_tokens=4, priority_class="interactive"),
        TraceRecord(id="D", arrival=2, prompt_tokens=20, output_tokens=2, priority_class="standard",
                    deadline=d_deadline),
    ]


def run(policy: str, d_deadline: float | None = None) -> dict:
    report = build_report(simulate(trace(d_deadline), resolve_config(None, POLICIES[policy]), UnitCost()))
    for step in report["steps"]:
        assert len(step["decode"]) + sum(n for _, n in step["prefill"]) <= 16
        assert step["kv_used_blocks"] <= 40
    return report


def by_id(report: dict) -> dict[str, dict]:
    return {r["id"]: r for r in report["requests"]}


def events(report: dict, request: str, kind: str) -> list[tuple[float, str]]:
    return [(e["t"], e["reason"]) for e in report["events"] if e["request"] == request and e["kind"] == kind]


def first_step(report: dict) -> list:
    s = report["steps"][0]
    return [*s["decode"], *s["prefill"]]


def test_fcfs_without_chunking_lets_a_long_prompt_own_the_step() -> None:
    r = run("fcfs_no_chunking")
    req = by_id(r)
    assert first_step(r) == [["A", 16]]  # A takes the whole budget: B waits behind it
    assert events(r, "B", "defer") == [(0, "token_budget")]
    assert req["B"]["first_token"] == 2
    # Memory runs out at t=3: the latest arrival among the equals (C) is the victim.
    assert r["steps"][3]["preempted"] == [["C", "recompute", "kv_blocks"]]
    assert events(r, "D", "defer") == [(2, "kv_blocks")]
    assert req["D"]["admitted"] == 5  # only after A finished and freed its 27 blocks
    assert all(x["status"] == "finished" for x in r["requests"])


def test_8_token_chunks_share_the_step() -> None:
    r = run("chunks_8")
    req = by_id(r)
    assert first_step(r) == [["A", 8], ["B", 4]]
    assert req["B"]["first_token"] == 1  # one step earlier than without chunking
    assert req["C"]["first_token"] == 3  # C waits behind A's chunks: no priority here
    assert req["C"]["preemptions"] == 1
    assert events(r, "D", "defer") == [(2, "kv_blocks")]
    assert req["D"]["admitted"] == 6
    assert r["summary"]["finished"] == 4


def test_priority_with_aging_serves_c_first_and_spares_it() -> None:
    r = run("priority_aging")
    req = by_id(r)
    chunks = run("chunks_8")
    # C (interactive) is admitted ahead of A's partial prefill the step it arrives.
    assert r["steps"][1]["prefill"][0] == ["C", 8]
    assert req["C"]["first_token"] == 2 < by_id(chunks)["C"]["first_token"]
    assert req["C"]["preemptions"] == 0
    assert req["C"]["finished"] == min(x["finished"] for x in r["requests"])
    # The victim is now the worst effective priority, latest admitted: B, not C.
    assert [p for s in r["steps"] for p in s["preempted"]] == [["B", "recompute", "kv_blocks"]]
    assert events(r, "D", "defer") == [(2, "kv_blocks")]
    assert req["D"]["admitted"] == 7
    assert r["classes"]["interactive"]["ttft"]["max"] == 1


def test_d_with_a_deadline_it_cannot_meet_is_rejected_not_run() -> None:
    r = run("priority_aging", d_deadline=8)
    d = by_id(r)["D"]
    # Deferred for memory at t=2; at t=5 it is next, but 3 chunks + 1 decode no longer fit before 8.
    assert events(r, "D", "defer") == [(2, "kv_blocks")]
    assert (d["status"], d["reason"], d["finished"]) == ("rejected", "deadline_unreachable", 5)
    assert d["admitted"] is None and d["output_tokens"] == 0
    assert all(rid != "D" for s in r["steps"] for rid in [*s["decode"], *(p[0] for p in s["prefill"])])


@pytest.mark.parametrize("deadline", [2.5, 4])
def test_d_is_rejected_at_arrival_when_even_an_empty_engine_is_too_slow(deadline: float) -> None:
    r = run("priority_aging", d_deadline=deadline)
    d = by_id(r)["D"]
    assert (d["status"], d["reason"], d["finished"]) == ("rejected", "deadline_unreachable", 2)
    assert events(r, "D", "reject") == [(2, "deadline_unreachable")]
