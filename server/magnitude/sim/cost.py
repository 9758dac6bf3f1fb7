"""Cost models: how long one step (a `StepPlan`) takes, in seconds (or steps under `unit`).

- `unit`: every step lasts 1.0 (times in the report are then step counts);
- `linear`: 0.020 + 0.000035 × prefill tokens + 0.0005 × decode sequences + 0.000013 × swapped
  tokens, constants overridable from a JSON file `{"kind": "linear", "base": ..., ...}`;
- a table from `magnitude profile`: `{"kind": "table", "decode_batch_sizes": [...],
  "prefill_tokens": [...], "seconds": [[...], ...]}` (rows: decode batch sizes, columns: prefill
  tokens), interpolated bilinearly and extrapolated linearly from the edges. The table is measured
  with every decode at `decode_context` tokens and the prefill as one sequence from position 0.
  With `per_decode_context_token` and `per_attention_pair` (`runner/attention_cost.py`) a step is
  charged for the attention it really does away from that shape: a decode per context token
  beyond (or short of) `decode_context`, a prefill chunk per query-key pair beyond what one
  sequence of all the step's chunk tokens would have. Decodes of long documents and chunks deep
  into a long prompt cost more; several short prompts in one step cost less than one long one.

The simulator and the server's simulated runner both call `step_seconds(plan)`. Pure.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol

from magnitude.engine.output import StepPlan
from magnitude.policy.schema import EngineConfig


class CostModelError(ValueError):
    """A cost model spec or file that cannot be used."""


def plan_shape(plan: StepPlan, block_size: int) -> tuple[int, int, int]:
    """(decode sequences, prefill tokens, swapped tokens) of a step. A decode is a one-token
    chunk that samples; its lookahead draft positions count as prefill-like tokens."""
    decodes = prefill = 0
    for s in plan.seqs:
        n = len(s.token_ids)
        if s.sample and n == 1:
            decodes += 1
            prefill += s.num_lookahead
        else:
            prefill += n + s.num_lookahead
    return decodes, prefill, (len(plan.swap_in) + len(plan.swap_out)) * block_size


class CostModel(Protocol):
    name: str

    def step_seconds(self, plan: StepPlan) -> float: ...

    def seconds_for(self, decodes: int, prefill_tokens: int, swapped_tokens: int = 0) -> float: ...


@dataclass(frozen=True)
class UnitCost:
    name: str = "unit"

    def step_seconds(self, plan: StepPlan) -> float:
        return 1.0

    def seconds_for(self, decodes: int, prefill_tokens: int, swapped_tokens: int = 0) -> float:
        return 1.0


@dataclass(frozen=True)
class LinearCost:
    base: float = 0.020
    per_prefill_token: float = 0.000035
    per_decode_seq: float = 0.0005
    per_swap_token: float = 0.000013
    block_size: int = 16
    name: str = "linear"

    def seconds_for(self, decodes: int, prefill_tokens: int, swapped_tokens: int = 0) -> float:
        return (self.base + self.per_prefill_token * prefill_tokens + self.per_decode_seq * decodes
                + self.per_swap_token * swapped_tokens)

    def step_seconds(self, plan: StepPlan) -> float:
        return self.seconds_for(*plan_shape(plan, self.block_size))


def _interp(xs: list[float], x: float) -> tuple[int, float]:
    """Index i and weight w so the value at x is (1-w)·v[i] + w·v[i+1] (w outside [0,1] extrapolates)."""
    if len(xs) == 1:
        return 0, 0.0
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


@dataclass(frozen=True)
class TableCost:
    decode_batch_sizes: tuple[float, ...]
    prefill_tokens: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]
    per_swap_token: float = 0.000013
    block_size: int = 16
    per_decode_context_token: float = 0.0
    per_attention_pair: float = 0.0
    decode_context: int = 256
    name: str = "table"

    def __post_init__(self) -> None:
        rows, cols = len(self.decode_batch_sizes), len(self.prefill_tokens)
        if rows < 1 or cols < 1 or len(self.seconds) != rows or any(len(r) != cols for r in self.seconds):
            raise CostModelError(f"table: seconds must be {rows} rows of {cols} values")
        for axis in (self.decode_batch_sizes, self.prefill_tokens):
            if list(axis) != sorted(set(axis)):
                raise CostModelError("table: axes must be strictly increasing")

    def _at(self, d: float, p: float) -> float:
        i, wi = _interp(list(self.decode_batch_sizes), d)
        j, wj = _interp(list(self.prefill_tokens), p)
        s = self.seconds

        def row(r: int) -> float:
            return s[r][j] if len(s[r]) == 1 else (1 - wj) * s[r][j] + wj * s[r][j + 1]

        v = row(i) if len(s) == 1 else (1 - wi) * row(i) + wi * row(i + 1)
        return max(v, 1e-6)

    def seconds_for(self, decodes: int, prefill_tokens: int, swapped_tokens: int = 0) -> float:
        return self._at(decodes, prefill_tokens) + self.per_swap_token * swapped_tokens

    def step_seconds(self, plan: StepPlan) -> float:
        decodes, prefill, swapped = plan_shape(plan, self.block_size)
        seconds = self.seconds_for(decodes, prefill, swapped)
        if self.per_decode_context_token or self.per_attention_pair:
            contexts, chunk_tokens, pairs = attention_shape(plan)
            seconds += self.per_decode_context_token * (contexts - decodes * (self.decode_context + 1))
            seconds += self.per_attention_pair * (pairs - chunk_tokens * (chunk_tokens + 1) // 2)
            seconds = max(seconds, 1e-6)
        return seconds


def attention_shape(plan: StepPlan) -> tuple[int, int, int]:
    """(the decodes' contexts summed, prefill chunk tokens, the chunks' query-key pairs): a chunk of
    n tokens from position s attends n*s + n(n+1)/2 keys in all; a decode its context plus itself."""
    contexts = tokens = pairs = 0
    for s in plan.seqs:
        n = len(s.token_ids)
        if s.sample and n == 1:
            contexts += s.start_position + 1
        else:
            n += s.num_lookahead
            tokens += n
            pairs += n * s.start_position + n * (n + 1) // 2
    return contexts, tokens, pairs


def derive_chunk_size(cost: CostModel, itl_target_s: float, decode_batch: int, token_budget: int) -> int:
    """The largest prefill chunk that keeps a step with `decode_batch` decodes within the
    inter-token latency target (at least 1, at most the budget left after the decodes)."""
    hi = max(1, token_budget - decode_batch)
    if cost.seconds_for(decode_batch, hi) <= itl_target_s:
        return hi
    lo = 1
    while lo < hi:  # cost is non-decreasing in prefill tokens
        mid = (lo + hi + 1) // 2
        if cost.seconds_for(decode_batch, mid) <= itl_target_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def resolve_prefill_chunk(config: EngineConfig, cost: CostModel) -> EngineConfig:
    """`prefillChunkSize` left null with an `itlTargetMs`: the largest chunk that keeps a step with a
    full decode batch (`maxSequences`) within the target under this cost model. The engine and the
    simulator both call this, so the integer is derived from a measurement, never borrowed."""
    sp = config.scheduler
    if sp.prefill_chunk_size is not None or sp.itl_target_ms is None:
        return config
    chunk = derive_chunk_size(cost, sp.itl_target_ms / 1000.0, sp.max_sequences, sp.token_budget)
    return config.model_copy(update={"scheduler": sp.model_copy(update={"prefill_chunk_size": chunk})})


def load_cost_model(spec: str, block_size: int = 16) -> CostModel:
    """`unit`, `linear`, or a JSON file (linear constants or a profile table)."""
    if spec == "unit":
        return UnitCost()
    if spec == "linear":
        return LinearCost(block_size=block_size)
    path = Path(spec)
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise CostModelError(f"--cost-model {spec}: not 'unit', 'linear' or a readable JSON file ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise CostModelError(f"{spec}: not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise CostModelError(f"{spec}: expected a JSON object")
    kind = doc.pop("kind", "table" if "seconds" in doc else "linear")
    doc.pop("meta", None)
    cls: type = {"linear": LinearCost, "table": TableCost}.get(kind)  # type: ignore[assignment]
    if cls is None:
        raise CostModelError(f"{spec}: kind: unknown cost model kind {kind!r} (linear, table)")
    known = {f.name for f in fields(cls)} - {"name"}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise CostModelError(f"{spec}: unknown key(s) {unknown} for a {kind} cost model (known: {sorted(known)})")
    doc.setdefault("block_size", block_size)
    try:
        if cls is TableCost:
            doc["decode_batch_sizes"] = tuple(float(x) for x in doc["decode_batch_sizes"])
            doc["prefill_tokens"] = tuple(float(x) for x in doc["prefill_tokens"])
            doc["seconds"] = tuple(tuple(float(x) for x in r) for r in doc["seconds"])
        else:
            for k, v in doc.items():
                if k != "block_size" and not isinstance(v, (int, float)):
                    raise CostModelError(f"{spec}: {k}: expected a number, got {v!r}")
        return cls(**doc)
    except KeyError as e:
        raise CostModelError(f"{spec}: missing key {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        if isinstance(e, CostModelError):
            raise
        raise CostModelError(f"{spec}: {e}") from e
