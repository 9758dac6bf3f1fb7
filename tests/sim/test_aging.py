"""Aging prevents starvation: a batch request waits behind a stream of interactive requests
without aging, and gets in after a bounded wait with it."""

from __future__ import annotations

import pytest

from magnitude.policy.load import resolve_config
from magnitude.sim.cost import UnitCost
from magnitude.sim.report import build_report
from magnitude.sim.simulate import simulate
from magnitude.sim.trace import TraceRecord

STREAM = 30


def trace() -> list[TraceRecord]:
    recs = [TraceRecord(id="batch", arrival=0, prompt_tokens=4, output_tokens=1, priority_class="batch")]
    # One interactive request per step, each done in the step that admits it: the engine is never idle.
    recs += [TraceRecord(id=f"i{k}", arrival=k, prompt_tokens=4, output_tokens=1, priority_class="interactive")
             for k in range(STREAM)]
    return recs


@pytest.mark.parametrize(("aging", "admitted_by"), [("null", None), ("2", 5.0)])
def test_aging_bounds_the_wait_of_a_low_priority_request(aging: str, admitted_by: float | None) -> None:
    config = resolve_config(None, ["scheduler.maxSequences=1", "scheduler.tokenBudget=16",
                                f"scheduler.agingSecondsPerLevel={aging}", "kvCache.numBlocks=64"])
    report = build_report(simulate(trace(), config, UnitCost()))
    batch = next(r for r in report["requests"] if r["id"] == "batch")
    assert batch["status"] == "finished"
    if admitted_by is None:
        assert batch["admitted"] >= STREAM  # starved for as long as the stream lasted
    else:
        # priority 2 at 2 s per level: after 4 s it ranks with interactive requests arriving now
        assert batch["admitted"] <= admitted_by
