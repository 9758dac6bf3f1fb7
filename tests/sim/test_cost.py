"""Cost models: unit, linear (constants from a file), profile tables (interpolated), and the
prefill chunk derived from an inter-token latency target."""

from __future__ import annotations

import json

import pytest

from magnitude.engine.output import ScheduledSeq, StepPlan
from magnitude.engine.sampling import SamplingParams
from magnitude.policy.load import resolve_config
from magnitude.sim.cost import CostModelError, LinearCost, TableCost, derive_chunk_size, load_cost_model
from magnitude.sim.simulate import resolve_sim_config


def plan(decodes: int, prefill: int, swaps: int = 0) -> StepPlan:
    sp = SamplingParams()
    seqs = [ScheduledSeq(f"d{i}", [1], 10, [0], True, sp) for i in range(decodes)]
    if prefill:
        seqs.append(ScheduledSeq("p", [1] * prefill, 0, [0], False, sp))
    return StepPlan(1, seqs, swap_out=[(0, 0)] * swaps)


def test_linear_cost_is_the_documented_formula() -> None:
    c = load_cost_model("linear", block_size=16)
    assert c.step_seconds(plan(10, 100, swaps=2)) == pytest.approx(0.020 + 0.0035 + 0.005 + 0.000013 * 32)
    assert load_cost_model("unit").step_seconds(plan(64, 2000)) == 1.0


def test_linear_constants_from_a_file(tmp_path) -> None:
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"kind": "linear", "base": 0.01, "per_decode_seq": 0.001}))
    c = load_cost_model(str(f))
    assert isinstance(c, LinearCost) and c.step_seconds(plan(5, 0)) == pytest.approx(0.015)


def test_table_interpolates_and_extrapolates(tmp_path) -> None:
    f = tmp_path / "profile.json"
    f.write_text(json.dumps({"decode_batch_sizes": [1, 9], "prefill_tokens": [0, 100],
                             "seconds": [[0.010, 0.020], [0.018, 0.028]]}))
    c = load_cost_model(str(f))
    assert isinstance(c, TableCost)
    assert c.step_seconds(plan(1, 0)) == pytest.approx(0.010)
    assert c.step_seconds(plan(5, 50)) == pytest.approx(0.019)  # bilinear midpoint
    assert c.step_seconds(plan(1, 200)) == pytest.approx(0.030)  # linear beyond the last column


def test_bad_table_is_refused(tmp_path) -> None:
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"decode_batch_sizes": [1, 2], "prefill_tokens": [0], "seconds": [[0.1]]}))
    with pytest.raises(CostModelError, match="2 rows of 1 values"):
        load_cost_model(str(f))


def test_chunk_derived_from_itl_target() -> None:
    c = LinearCost()
    # 0.020 + 64 * 0.0005 = 0.052 s for the decodes; 0.010 s more buys 285 prefill tokens.
    assert derive_chunk_size(c, 0.062, 64, 2048) == 285
    assert derive_chunk_size(c, 10.0, 64, 2048) == 2048 - 64
    assert derive_chunk_size(c, 0.001, 64, 2048) == 1
    cfg = resolve_sim_config(resolve_config(None, ["scheduler.prefillChunkSize=null", "scheduler.itlTargetMs=62"]), c)
    assert cfg.scheduler.prefill_chunk_size == 285 and cfg.kv_cache.num_blocks is not None
