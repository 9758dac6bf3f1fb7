"""The table cost model's attention terms: a step is charged for the attention it really does away
from the shape the table was measured at (decodes at `decode_context`, one prefill sequence)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from magnitude.engine.output import ScheduledSeq, StepPlan
from magnitude.engine.sampling import SamplingParams
from magnitude.sim.cost import TableCost, load_cost_model

GREEDY = SamplingParams(max_tokens=1)
TABLE = dict(decode_batch_sizes=(0.0, 8.0), prefill_tokens=(0.0, 512.0), seconds=((0.01, 0.51), (0.05, 0.55)))


def decode(rid: str, context: int) -> ScheduledSeq:
    return ScheduledSeq(rid, [1], context, [], True, GREEDY)


def chunk(rid: str, start: int, n: int, sample: bool = False) -> ScheduledSeq:
    return ScheduledSeq(rid, [1] * n, start, [], sample, GREEDY)


def test_attention_shape_counts_contexts_and_query_key_pairs() -> None:
    plan = StepPlan(1, [decode("a", 100), decode("b", 300), chunk("c", 0, 4), chunk("d", 10, 2, sample=True)])
    # contexts: the decodes' 101 + 301 and the 10 positions before chunk d; chunks: 4 tokens from 0
    # (1+2+3+4 pairs) and 2 from 10 (11+12)
    assert plan.attention_load() == (412, 6, 10 + 23)


def test_without_attention_figures_a_step_costs_what_the_table_says() -> None:
    cost = TableCost(**TABLE)
    plan = StepPlan(1, [decode("a", 3000), chunk("c", 2000, 256)])
    assert cost.step_seconds(plan) == pytest.approx(cost.seconds_for(1, 256))


def test_long_contexts_cost_more_and_short_prompts_together_cost_less() -> None:
    cost = TableCost(**TABLE, per_decode_context_token=1e-5, per_attention_pair=1e-7, decode_context=256)
    at_table = StepPlan(1, [decode("a", 256)])
    long_doc = StepPlan(1, [decode("a", 1024)])
    assert cost.step_seconds(at_table) == pytest.approx(cost.seconds_for(1, 0))
    assert cost.step_seconds(long_doc) - cost.step_seconds(at_table) == pytest.approx(768 * 1e-5)
    one_prompt = StepPlan(1, [chunk("p", 0, 512)])
    four_prompts = StepPlan(1, [chunk(f"p{i}", 0, 128) for i in range(4)])
    deep_chunk = StepPlan(1, [chunk("p", 1520, 512)])
    assert cost.step_seconds(one_prompt) == pytest.approx(cost.seconds_for(0, 512))  # the table's own shape
    saved = (512 * 513 // 2 - 4 * (128 * 129 // 2)) * 1e-7
    assert cost.step_seconds(one_prompt) - cost.step_seconds(four_prompts) == pytest.approx(saved)
    # a deep chunk reads its 1,520 earlier positions, as a decode reads its context, and attends more pairs
    assert cost.step_seconds(deep_chunk) - cost.step_seconds(one_prompt) == pytest.approx(1520 * 1e-5 + 512 * 1520 * 1e-7)


def test_beyond_the_table_short_prompts_are_discounted_only_by_pairs_the_table_charged() -> None:
    """The table's last column is 512 tokens, extrapolated linearly: 2,048 prefill tokens carry 4x the
    pairs of one 512-token prompt, not those of one 2,048-token prompt (4x more again)."""
    cost = TableCost(**TABLE, per_attention_pair=1e-7)
    eight_prompts = StepPlan(1, [chunk(f"p{i}", 0, 256) for i in range(8)])
    charged = 4 * (512 * 513 // 2)
    assert cost.step_seconds(eight_prompts) == pytest.approx(cost.seconds_for(0, 2048) - (charged - 8 * (256 * 257 // 2)) * 1e-7)
    assert cost.step_seconds(eight_prompts) > cost.seconds_for(0, 2048) * 0.9  # a quadratic baseline took off 0.18 s of 2.0


def test_draft_positions_attend_their_context() -> None:
    """A decode with k draft positions after it: they are computed beside the decode and each attends
    the whole context before it (k*(s+1) + k(k+1)/2 pairs)."""
    plan = StepPlan(1, [ScheduledSeq("a", [1], 1000, [], True, GREEDY, num_lookahead=4)])
    assert plan.attention_load() == (1001, 4, 4 * 1001 + 10)
    cost = TableCost(**TABLE, per_attention_pair=1e-7)
    far = StepPlan(1, [ScheduledSeq("a", [1], 1000, [], True, GREEDY, num_lookahead=4)])
    near = StepPlan(1, [ScheduledSeq("a", [1], 10, [], True, GREEDY, num_lookahead=4)])
    assert cost.step_seconds(far) - cost.step_seconds(near) == pytest.approx(4 * 990 * 1e-7)


def test_a_profile_file_carries_the_attention_figures(tmp_path: Path) -> None:
    doc = {"kind": "table", "decode_batch_sizes": [0, 8], "prefill_tokens": [0, 512], "seconds": [[0.01, 0.51], [0.05, 0.55]],
           "per_decode_context_token": 2e-5, "per_attention_pair": 3e-7, "decode_context": 128, "meta": {}}
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(doc))
    cost = load_cost_model(str(path))
    assert isinstance(cost, TableCost)
    assert (cost.per_decode_context_token, cost.per_attention_pair, cost.decode_context) == (2e-5, 3e-7, 128)
