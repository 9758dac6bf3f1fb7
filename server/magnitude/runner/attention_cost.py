"""The cost model's attention figures: what a step costs away from the step table's measured shape.

The step table (`magnitude profile`, the start-up calibration) is measured with every decode at
one context length and the prefill chunk from position 0, so it cannot tell a decode of a 3,000-
token document from one of a 200-token chat, nor a chunk deep into a long prompt from the first
one. `measure_attention` times the same real steps at two context lengths: `decodes` decodes at
`context` (the table's) and at a far context (FAR_FACTOR x, as far as the KV pool and the model's
context allow), and a prefill chunk of `chunk` tokens starting at 0 and ending at the far context,
over pool blocks written first (`materialize`), as a request's are.
Near and far run back to back, after one unmeasured run each, and a slope is the median of the
paired differences (at least MIN_REPEATS pairs): a burst of other processes' load then spoils one
pair, not one side of the slope, and a far context 8x the near one makes the difference several
times a step's own jitter. The slopes
are `per_decode_context_token` (seconds per context token a sequence reads: a decode's context,
a chunk's earlier positions) and `per_attention_pair` (seconds per query-key pair of a prefill
chunk, after its reading is charged at the first slope), which `sim/cost.py TableCost` charges away from
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


MIN_REPEATS = 3  # a slope is a difference of two times: one pair is too noisy
FAR_FACTOR = 8
# Decodes at the far context: their blocks are written before they are read (see
# materialize_kv_blocks), so they are memory the process holds while it measures: 8 x 2,048 tokens
# of SmolLM2's fp32 K/V are 760 MiB, 2 are 190 MiB, and two sequences' difference (about 8 ms with
# w4a16 on two EPYC cores) is still several times a step's jitter.
ATTENTION_DECODES = 2



@dataclass(frozen=True)
class AttentionFigures:
    per_decode_context_token: float  # seconds per decode per context token
    per_attention_pair: float  # seconds per query-key pair of a prefill chunk
    decode_context: int  # the table's decode context these correct from

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


def _paired_difference(runner: Any, near: StepPlan, far: StepPlan, repeats: int) -> float:
    """Median of (far - near) over pairs run back to back, after one unmeasured run of each
    (first-shape effects)."""
    runner.execute(near)
    runner.execute(far)
    diffs = []
    for _ in range(max(MIN_REPEATS, repeats)):
        a = runner.execute(near).duration_s
        diffs.append(runner.execute(far).duration_s - a)
    return statistics.median(diffs)


def materialize(runner: Any, blocks: int) -> None:
    """Have the runner write the pool blocks a measurement will read (runner.materialize_kv_blocks:
    unwritten CPU pages all read as the kernel's one cached zero page, which would time every
    context as free). Runners without a pool of their own (the simulated runner, test doubles)
    have nothing to write."""
    write = getattr(runner, "materialize_kv_blocks", None)
    if write is not None:
        write(blocks)


def measure_attention(runner: Any, context: int = 256, decodes: int = ATTENTION_DECODES, chunk: int = 128,
                      repeats: int = 5) -> AttentionFigures:
    bs = runner.block_size
    far = min(FAR_FACTOR * context, runner.num_blocks * bs - 1, getattr(runner, "max_model_len", 1 << 30) - 1)
    if far <= context:  # nothing to compare: no correction
        return AttentionFigures(0.0, 0.0, context)
    d = max(1, min(decodes, runner.num_blocks // _blocks(far, 1, bs)))
    materialize(runner, d * _blocks(far, 1, bs))
    decode_slope = _paired_difference(runner, _decode_plan(d, context, bs), _decode_plan(d, far, bs),
                                      repeats) / (d * (far - context))
    n = min(chunk, far)
    start = far - n
    prefill_slope = 0.0
    if start:
        # A deep chunk also reads its `start` earlier positions, as a decode reads its context: the
        # cost model charges that at the decode slope, so the pair slope is what is left.
        extra = _paired_difference(runner, _chunk_plan(0, n, bs), _chunk_plan(start, n, bs), repeats)
        prefill_slope = (extra - max(0.0, decode_slope) * start) / (n * start)
    # A negative slope is noise around zero (a busy machine), not cheaper attention.
    return AttentionFigures(max(0.0, decode_slope), max(0.0, prefill_slope), context)
