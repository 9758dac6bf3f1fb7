"""The cost model's attention figures: what a step costs away from the step table's measured shape.

The step table (`magnitude profile`, the start-up calibration) is measured with every decode at
one context length and the prefill chunk from position 0, so it cannot tell a decode of a 3,000-
token document from one of a 200-token chat, nor a chunk deep into a long prompt from the first
one. `measure_attention` times the same real steps at two context lengths: `decodes` decodes at
`contexts[0]` and at `contexts[1]` tokens, and a prefill chunk of `chunk` tokens starting at 0 and
at `contexts[1] - chunk` (the median of `repeats` runs each, after one unmeasured run). The slopes
are `per_decode_context_token` (seconds per decode per context token) and `per_attention_pair`
(seconds per query-key pair of a prefill chunk), which `sim/cost.py TableCost` charges away from
the table's measured shape. They are kept apart because decode attention (one query gathering a
long paged context) and chunk attention (many queries at once) cost very differently per pair.
Torch-free at import, like the other measuring functions the CLI imports.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from magnitude.engine.output import ScheduledSeq, StepPlan
from magnitude.engine.sampling import SamplingParams


@dataclass(frozen=True)
class AttentionFigures:
    per_decode_context_token: float  # seconds per decode per context token
    per_attention_pair: float  # seconds per query-key pair of a prefill chunk
    decode_context: int  # the table's decode context these correct from (contexts[0])

    def to_document(self) -> dict:
        """The cost-model keys (sim/cost.py TableCost)."""
        return {"per_decode_context_token": self.per_decode_context_token,
                "per_attention_pair": self.per_attention_pair, "decode_context": self.decode_context}


def _blocks(start: int, n: int, block_size: int) -> int:
    return -(-(start + n) // block_size)


def _decode_plan(d: int, context: int, block_size: int) -> StepPlan:
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    per = _blocks(context, 1, block_size)
    return StepPlan(0, [ScheduledSeq(f"d{i}", [100], context, list(range(i * per, (i + 1) * per)), True, greedy)
                        for i in range(d)])


def _chunk_plan(start: int, n: int, block_size: int) -> StepPlan:
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    return StepPlan(0, [ScheduledSeq("p", [100] * n, start, list(range(_blocks(start, n, block_size))), True, greedy)])


def _time(runner: Any, plan: StepPlan, repeats: int) -> float:
    runner.execute(plan)  # unmeasured: first-shape effects
    return statistics.median(runner.execute(plan).duration_s for _ in range(max(1, repeats)))


def measure_attention(runner: Any, decodes: int = 8, contexts: tuple[int, int] = (256, 1024), chunk: int = 128,
                      repeats: int = 3) -> AttentionFigures:
    lo, hi = contexts
    bs = runner.block_size
    d = max(1, min(decodes, runner.num_blocks // _blocks(hi, 1, bs)))
    decode_slope = (_time(runner, _decode_plan(d, hi, bs), repeats)
                    - _time(runner, _decode_plan(d, lo, bs), repeats)) / (d * (hi - lo))  # per decode per token
    start = max(0, hi - chunk)
    prefill_slope = (_time(runner, _chunk_plan(start, chunk, bs), repeats)
                     - _time(runner, _chunk_plan(0, chunk, bs), repeats)) / (chunk * start) if start else 0.0
    # A negative slope is noise around zero (a busy machine), not cheaper attention.
    return AttentionFigures(max(0.0, decode_slope), max(0.0, prefill_slope), lo)
