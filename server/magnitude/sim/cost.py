"""Cost models: how long one step (a `StepPlan`) takes, in seconds (or steps under `unit`).

- `unit`: every step lasts 1.0 (times in the report are then step counts);
- `linear`: 0.020 + 0.000035 × prefill tokens + 0.0005 × decode sequences + 0.000013 × swapped
  tokens, constants overridable from a JSON file `{"kind": "linear", "base": ..., ...}`;
- a table from `magnitude profile`: `{"kind": "table", "decode_batch_sizes": [...],
  "prefill_tokens": [...], "seconds": [[...], ...]}` (rows: decode batch sizes, columns: prefill
  tokens), interpolated bilinearly and extrapolated linearly from the edges. The table is measured
  with every decode at `decode_context` tokens and the prefill as one sequence from position 0.
  With `per_decode_context_token` and `per_attention_pair` (`runner/attention_cost.py`, measured
  by the calibration) a step is charged for the attention it really does away from that shape:
  every sequence per context token it reads (a decode's beyond or short of `decode_context`, a
  chunk's positions before it), and per query-key pair of its chunks and draft positions beyond
  what the table's time for that many prefill tokens carries (its columns are one sequence from
  position 0, interpolated linearly). Decodes of long documents and chunks deep into a long
  prompt cost more; several short prompts in one step cost less than one long one.

The simulator and the server's simulated runner call `step_seconds(plan)`; the scheduler's ITL
bound calls `seconds_for` with the step's `AttentionLoad` as it builds the step. Pure.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol

from magnitude.engine.output import AttentionLoad, StepPlan
from magnitude.engine.scheduler import largest_fitting
from magnitude.policy.schema import STATIC_PREFILL_CHUNK, STATIC_TOKEN_BUDGET, EngineConfig, SchedulerPolicy


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

    def seconds_for(self, decodes: int, prefill_tokens: int, swapped_tokens: int = 0,
                    attention: AttentionLoad | None = None) -> float:
        """A step of this shape; `attention` None: at the shape the model was measured at (the
        unit and linear models have no attention terms and ignore it)."""
        ...


@dataclass(frozen=True)
class UnitCost:
    name: str = "unit"

    def step_seconds(self, plan: StepPlan) -> float:
        return 1.0

    def seconds_for(self, decodes: int, prefill_tokens: int, swapped_tokens: int = 0,
                    attention: AttentionLoad | None = None) -> float:
        return 1.0


@dataclass(frozen=True)
class LinearCost:
    base: float = 0.020
    per_prefill_token: float = 0.000035
    per_decode_seq: float = 0.0005
    per_swap_token: float = 0.000013
    block_size: int = 16
    name: str = "linear"

    def seconds_for(self, decodes: int, prefill_tokens: int, swapped_tokens: int = 0,
                    attention: AttentionLoad | None = None) -> float:
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

    def seconds_for(self, decodes: int, prefill_tokens: int, swapped_tokens: int = 0,
                    attention: AttentionLoad | None = None) -> float:
        seconds = self._at(decodes, prefill_tokens) + self.per_swap_token * swapped_tokens
        if attention is not None and (self.per_decode_context_token or self.per_attention_pair):
            contexts, chunk_tokens, pairs = attention
            seconds += self.per_decode_context_token * (contexts - decodes * (self.decode_context + 1))
            seconds += self.per_attention_pair * (pairs - self._table_pairs(chunk_tokens))
            seconds = max(seconds, 1e-6)
        return seconds

    def _table_pairs(self, tokens: int) -> float:
        """The query-key pairs the table's own time for `tokens` prefill tokens carries: each column
        was measured as one sequence from position 0 (n(n+1)/2 pairs), and the table interpolates and
        extrapolates linearly between columns, so the pairs it implies do too. (Beyond the last
        column they grow linearly, not quadratically: n(n+1)/2 there would discount several short
        prompts by pairs the table never charged.)"""
        xs = self.prefill_tokens
        j, w = _interp(list(xs), tokens)
        lo = xs[j] * (xs[j] + 1) / 2
        return lo if len(xs) == 1 else (1 - w) * lo + w * xs[j + 1] * (xs[j + 1] + 1) / 2

    def step_seconds(self, plan: StepPlan) -> float:
        return self.seconds_for(*plan_shape(plan, self.block_size), attention=plan.attention_load())


# Served steps run dearer than the table: the engine's loop schedules, runs and books each step,
# and on a CPU the HTTP side and the clients share the cores (steps 10-30% over the table in the
# server where the same steps alone ran within 3%, bench/results/sim_fidelity.md). What they add is
# mostly a fixed cost per step, not a share of it: over a mixed trace on two EPYC cores (w4a16) the
# steps predicted under 10 ms ran 1.69x the table, those of 30-40 ms 1.23x and those of 70-100 ms
# 1.0x; one line, 8.6 ms + 0.954x the prediction, left 7.1 ms of scatter where a single ratio (1.19x)
# left 8.7 ms (bench/results/sim_fidelity.md, 2026-12-03). So the engine fits
# real = fixed + scale x predicted over the last SERVED_WINDOW steps it serves (what a running stream
# waits between two tokens: from one decoding step's start to the next's), least squares, so the
# big steps an ITL bound cuts weigh by their seconds, with the table's own scale (1x) as a prior worth
# a spread of SERVED_PRIOR_SPREAD of the mean prediction: scale = (cov + c^2) / (var + c^2), c that
# spread. Where the window's predictions hardly differ a line through them says nothing about its
# slope, so the scale stays near 1x and what the steps took beyond the table is the fixed cost (what
# the evidence above says the excess mostly is; a ratio there would keep steps as small as the table
# derived them, since it stretches every step alike: in the engine w4a16's first steps, all of the
# table's derived size, fitted 1.3-1.6x and re-derived the same 16-token chunk). Where the window
# spreads the least-squares line takes over smoothly. With a hard switch at a 25% spread and the
# bare slope past it, consecutive windows on one AVX2 host fitted 17.4 ms + 0.858x and then 1.12x,
# and the derived limits went 27/16 -> 39/31 -> 27/16 within 128 steps; with the prior no run there
# changed its budget or chunk (bench/results/derived_defaults.md, 2026-12-04). Where the steps took less than the table, or the line's fixed cost comes out negative,
# the model is the ratio of the summed seconds (fixed 0), so a small step is never free. The fixed
# cost stays within [0, SERVED_MAX_FIXED_S] (beyond it the rest is a scale) and the scale within
# SERVED_FACTOR_BOUNDS. A step counts at most SERVED_MAX_FIXED_S + SERVED_FACTOR_BOUNDS[1] times
# its prediction (one stall on a shared host must not set the bound for the next few hundred
# steps). Steps predicted under SERVED_MIN_PREDICTED_S are not judged.
#
# What served steps add also grows with the decodes they carry. Over the 24-request burst and then
# the long-prompt trace on two AVX-512 EPYC cores (w4a16-bf16prefill, 2026-12-04), decode-only steps
# waited 1.25-1.49x the table and steps with a prompt chunk 1.03-1.19x, and the gap between two
# steps (booking and streaming each token) grew from 0.8 ms at 1 decode to 2.4 ms at 22. A line with
# a fixed cost only takes the decodes' excess as a fixed cost every step pays: after the burst it
# fitted 20.9-25.8 ms + 1.0-1.07x, prefill-only steps, which carry no decodes, were charged it too,
# only 256-token steps looked efficient, and the derived target became 273-293 ms
# (bench/results/derived_defaults.md). So the line has a third term,
# real = fixed + per_decode x decodes + scale x predicted, the per-decode cost with a prior of 0
# worth a spread of SERVED_PRIOR_SPREAD of the mean decode count, as the scale's: where the window's
# steps carry about the same number of decodes their share cannot be told from the fixed cost and
# stays with it (the two-term line exactly), where they differ it is the window's own. It stays
# within [0, SERVED_MAX_PER_DECODE_S]; at 0 the two-term line above, and its rules, hold. A step's
# count is capped at SERVED_MAX_PER_DECODE_S a decode more than the cap above.
#
# Served steps also scatter about the line, and not only step by step: on a shared host whole
# phases of seconds run slow. On two EPYC cores the long-prompt trace's chunk steps ran 1.35-1.6x
# their predictions for seconds at a time, with both compute threads busy, where the same shapes
# alone ran 0.91-1.00x the table (bench/results/derived_defaults.md, 2026-12-04). A bound on the
# line keeps a target only on average: about half of the steps sized to it run over, and a
# stream's longest gap is one of them. So the scheduler bounds steps by the line times (1 + margin)
# (ServedBound), the margin the largest relative residual (real / line - 1) among the window's big
# steps: those whose line time is at least SERVED_MARGIN_BIG_STEP of the window's longest, since the
# steps a target cuts are the big ones (small decode steps scatter more and would overstate it). A
# target is a promise about every step a stream waits on, and a stream's stall is its worst gap: with
# the 90th percentile (weighted by line seconds) the long-prompt trace's chat stalls ran 0.98-1.17x
# the derived target in force, run after run (two AVX2 EPYC cores, bench/results/derived_defaults.md,
# 2026-12-07). It stays within [0, SERVED_MAX_MARGIN] and is refitted every SERVED_MARGIN_EVERY judged
# steps.
#
# The margin moves with the host's phases: one mixed trace's engine ended at the cap, 0.5. A
# replay's own steps take the line exactly and learn no scatter, and one that kept the end's margin
# throughout sized every step after its 16th for the worst phase: ITL p50 0.80x the engine's where,
# with no margin, 1.18x; a burst's replay went the other way (1.02x with the end's margin, 1.18x
# with none). An engine whose margin went from 0.04 to 0.29 over a run replayed at 0.85x with the
# end's margin and 1.05x following it (bench/results/sim_fidelity.md, 2026-12-05). So the
# learner keeps when its margin moved by SERVED_MARGIN_HISTORY_STEP or more (`margin_history`:
# seconds on the caller's clock, the last SERVED_MARGIN_HISTORY moves), the document carries it
# (`meta.servedMarginHistory`, on the engine's clock, which recorded traces share), and a replay on
# that clock follows it.
SERVED_MARGIN_BIG_STEP = 0.5
SERVED_MAX_MARGIN = 0.5
# Until the line is fitted (SERVED_MIN_STEPS judged steps) an engine does not know how its served
# steps scatter about the table, and a cold start's are the worst: the first burst after a start ran
# 1.2-1.6x the table while the HTTP side took its requests and began their streams (1.35x on the
# early ratio the bound then used), and 18 of its 69 decoding gaps ran over the table's derived
# 81.3 ms target, none of the next two bursts' 127 (default weights, two AMX Xeon cores,
# bench/results/derived_defaults.md, 2026-12-07). So the engine's bound keeps the largest margin
# until then (ServedBound's `cold_margin`), and a target derived at start carries it (the limits are
# derived on the table, the target then scaled: sim/served_limits.py LimitsFollower): a derived
# target's steps are the same, and its promise is one that holds (the
# first bursts after three starts: 0, 2 and 0 of 68-69 gaps over); an explicit target's first steps
# are that much smaller. A replay of an engine's document starts cold as the engine did; a plain
# table's simulation, whose steps take the table, keeps none (sim/simulate.py cold_margin).
SERVED_COLD_MARGIN = SERVED_MAX_MARGIN
SERVED_MARGIN_EVERY = 16
SERVED_MARGIN_HISTORY = 256
SERVED_MARGIN_HISTORY_STEP = 0.01
SERVED_WINDOW = 256
SERVED_FACTOR_BOUNDS = (0.5, 4.0)
SERVED_MAX_FIXED_S = 0.05
SERVED_MAX_PER_DECODE_S = 0.005
SERVED_PRIOR_SPREAD = 0.25
SERVED_MIN_PREDICTED_S = 1e-3
# Steps observed before the window's fit replaces the starting model (1x and 0 s, or a document's):
# the first steps of a process (first shapes, cold caches) say little about the ones after, and a
# line through a few steps of one shape says nothing of its slope. From SERVED_EARLY_STEPS until
# then the model is the ratio of their summed seconds (no fixed cost): the steps sized to a target
# in those first seconds are the ones it cuts, and on the table alone they ran over it. With
# itlTargetMs 150 on two EPYC cores (w4a16-bf16prefill), a 24-request burst's first 17 steps took
# 186-214 ms against 149-150 ms predicted (served steps 1.27x the table); from the line on, 130-150 ms.
SERVED_EARLY_STEPS = 4
SERVED_MIN_STEPS = 16
# Null limits are derived from served step times (derivation_model) as soon as the line is fitted,
# at SERVED_MIN_STEPS judged steps, and again every SERVED_DERIVE_STEPS more (sim/served_limits.py
# LimitsFollower). The bound follows the served line from then on, so a target derived from the table
# must not outlive it: bf16 on two AMX Xeon cores served 24 decodes at 164 ms against the table's
# 105, and until the 64th judged step (the first derivation then) the table's 194.6 ms target left
# the mixed trace's prompt chunks a few dozen tokens: 0.77 and 0.87 of the best budget's throughput
# in two runs, 0.91 derived at the 16th (bench/results/derived_defaults.md). The line fitted on the
# first 16 steps of a burst puts the decodes' share in the fixed cost (their counts do not vary);
# the next derivation, 64 steps on, sees more shapes.
SERVED_DERIVE_STEPS = 64
# The line itself moves over a run, and most in its first seconds: on two AVX2 EPYC cores an engine's
# 16th judged step fitted 18.9 ms + 1.77 ms a decode + 1.048x, its end 16.8 ms + 0.975x. A replay
# priced on the end's line ran its first seconds' steps cheaper than the engine's, its bound left
# room the engine's did not, and it admitted interactive requests 1-2 s sooner: TTFT p50 0.57 of the
# engine's. Priced on the line in force at each step (below), two later runs' ITL p50 and E2E p50
# came within 6% of the engine's (1.12-1.45x and 1.03-1.20x on the end's line) and TTFT p50 0.72 and
# 1.24 (0.59 and 0.53) (bench/results/sim_fidelity.md, 2026-12-06). So the learner keeps when its line moved
# (`line_history`: seconds on the caller's clock, fixed, per decode and scale, each time the line's
# time for the window's mean step moved by SERVED_LINE_HISTORY_STEP or more, the last
# SERVED_LINE_HISTORY moves), the document carries it (`meta.servedLineHistory`, on the engine's
# clock, which recorded traces share), and a replay on that clock prices each step on the line in
# force at its start (`ServedCost.step_seconds_at`).
SERVED_LINE_HISTORY = 256
SERVED_LINE_HISTORY_STEP = 0.01
# Prefill-only steps (no decodes) are not on the line: no stream waits on them, and the line's fixed
# and per-decode terms are what decoding steps pay beside the table. A replay must still price
# them, and a long prompt's chunks are a third of some traces' time. On two AVX2 EPYC cores runs of
# one mixed trace fitted lines of 0.83x and 1.18x the table, and a burst's line was 4.9 ms + 0.99x
# while its prefill-only steps took 1.12x the table (bench/results/sim_fidelity.md). So the
# learner keeps their own ratio, what they took summed over what the table predicted for them
# (from one step's start to the next's, as a decoding step is judged), over the last SERVED_WINDOW
# of them, from SERVED_EARLY_STEPS on (`prefill_only_factor`, `meta.servedPrefillOnlyOverPredicted`);
# a replay prices prefill-only steps by it (`ServedCost.replayed_seconds`). The limits are still
# derived on the line: its fixed cost is what makes small steps dear (derivation_model).


class ServedCost:
    """A cost model in seconds whose predictions are what served steps take: `fixed_s`, plus
    `per_decode_s` per decode the step carries, plus `factor` times the model's (for a step that does
    any work). The engine calls `observe(predicted, real, decodes)` for each step it serves; a
    document from `GET /debug/cost-model` carries all three (`meta.servedFixedSeconds`,
    `meta.servedPerDecodeSeconds`, `meta.servedOverPredicted`), so the simulator replays with served
    step times (cost_model_from_document), and the steps' scatter about them (`margin`,
    `meta.servedNoiseMargin`: see SERVED_MARGIN_BIG_STEP), which the scheduler's bound adds
    (ServedBound), and when that margin moved (`margin_history`, `meta.servedMarginHistory`: see
    SERVED_MARGIN_HISTORY) and when the line moved (`line_history`, `meta.servedLineHistory`: see
    SERVED_LINE_HISTORY), and what prefill-only steps take against the table (`prefill_only_factor`,
    `meta.servedPrefillOnlyOverPredicted`: see the note after SERVED_LINE_HISTORY_STEP), by which a
    replay prices them. The table itself (`model`) stays what the calibration measured; null limits are
    derived from the served times once SERVED_MIN_STEPS steps are judged (derivation_model), from
    the table before (a derived target with a cold start's margin: SERVED_COLD_MARGIN)."""

    def __init__(self, model: CostModel, factor: float = 1.0, steps: int = 0, fixed_s: float = 0.0,
                 per_decode_s: float = 0.0, margin: float = 0.0,
                 margin_history: tuple[tuple[float, float], ...] = (),
                 line_history: tuple[tuple[float, float, float, float], ...] = (),
                 prefill_only_factor: float | None = None, prefill_only_steps: int = 0) -> None:
        self.model = model
        self.factor = factor
        self.fixed_s = fixed_s
        self.per_decode_s = per_decode_s
        self.margin = margin
        # (seconds, margin) each time the margin moved, on the clock of observe's `at`.
        self.margin_history: deque[tuple[float, float]] = deque(margin_history, maxlen=SERVED_MARGIN_HISTORY)
        # (seconds, fixed, per decode, scale) each time the line moved, on the same clock.
        self.line_history: deque[tuple[float, float, float, float]] = deque(line_history, maxlen=SERVED_LINE_HISTORY)
        self.steps = steps  # served steps observed, including those the model was read with
        # (predicted, counted real, decodes)
        self._window: deque[tuple[float, float, float]] = deque(maxlen=SERVED_WINDOW)
        # The window's sums of p, r, d and their products (p predicted, r real, d decodes).
        self._sp = self._sr = self._spp = self._spr = 0.0
        self._sd = self._sdd = self._sdp = self._sdr = 0.0
        # Prefill-only steps' ratio to the table (the note on them after SERVED_LINE_HISTORY_STEP); None
        # until SERVED_EARLY_STEPS are judged, and the line prices them till then.
        self.prefill_only_factor = prefill_only_factor
        self.prefill_only_steps = prefill_only_steps
        self._prefill_only: deque[tuple[float, float]] = deque(maxlen=SERVED_WINDOW)  # (predicted, counted real)
        self._po_p = self._po_r = 0.0

    @property
    def name(self) -> str:
        per_decode = f" + {self.per_decode_s * 1000:.2f} ms a decode" if self.per_decode_s else ""
        prefill_only = f", prefill-only steps x {self.prefill_only_factor:.3f}" \
            if self.prefill_only_factor is not None else ""
        return f"{self.model.name} x {self.factor:.3f} + {self.fixed_s * 1000:.1f} ms{per_decode} served{prefill_only}"

    def observe(self, predicted_s: float, real_s: float, decodes: int = 0, at: float | None = None) -> None:
        """A served step: the table predicted `predicted_s`, it took `real_s` carrying `decodes`
        decodes; `at` (when it was judged, on the caller's clock) dates a margin it moves."""
        if predicted_s < SERVED_MIN_PREDICTED_S or real_s <= 0.0:
            return
        if len(self._window) == self._window.maxlen:
            self._add(*self._window[0], -1.0)
        r = _counted_seconds(predicted_s, real_s, decodes)
        self._window.append((predicted_s, r, float(decodes)))
        self._add(predicted_s, r, float(decodes), 1.0)
        self.steps += 1
        if len(self._window) >= SERVED_MIN_STEPS:
            self.fixed_s, self.factor, self.per_decode_s = self._fit()
            if len(self._window) == SERVED_MIN_STEPS or self.steps % SERVED_MARGIN_EVERY == 0:
                self.margin = self._margin()
                moved = (not self.margin_history
                         or abs(self.margin_history[-1][1] - self.margin) >= SERVED_MARGIN_HISTORY_STEP)
                if at is not None and moved:
                    self.margin_history.append((at, self.margin))
        elif len(self._window) >= SERVED_EARLY_STEPS:
            lo, hi = SERVED_FACTOR_BOUNDS
            self.fixed_s, self.per_decode_s, self.factor = 0.0, 0.0, min(hi, max(lo, self._sr / self._sp))
        if at is not None and len(self._window) >= SERVED_EARLY_STEPS and self._line_moved():
            self.line_history.append((at, self.fixed_s, self.per_decode_s, self.factor))

    def observe_prefill_only(self, predicted_s: float, real_s: float) -> None:
        """A served step without decodes: the table predicted `predicted_s`, it took `real_s`."""
        if predicted_s < SERVED_MIN_PREDICTED_S or real_s <= 0.0:
            return
        lo, hi = SERVED_FACTOR_BOUNDS
        if len(self._prefill_only) == self._prefill_only.maxlen:
            p, r = self._prefill_only[0]
            self._po_p -= p
            self._po_r -= r
        r = _counted_seconds(predicted_s, real_s)
        self._prefill_only.append((predicted_s, r))
        self._po_p += predicted_s
        self._po_r += r
        self.prefill_only_steps += 1
        if len(self._prefill_only) >= SERVED_EARLY_STEPS:
            self.prefill_only_factor = min(hi, max(lo, self._po_r / self._po_p))

    def _line_moved(self) -> bool:
        """Whether the line's time for the window's mean step (mean prediction, mean decodes) moved
        by SERVED_LINE_HISTORY_STEP or more since the history's last entry (always, with none)."""
        if not self.line_history:
            return True
        n = len(self._window)
        p, d = self._sp / n, self._sd / n
        before = self._served(p, d, self.line_history[-1][1:])
        return abs(self._served(p, d) - before) >= SERVED_LINE_HISTORY_STEP * before

    def _margin(self) -> float:
        """The largest relative residual about the line among the window's big steps, within
        [0, SERVED_MAX_MARGIN] (see SERVED_MARGIN_BIG_STEP)."""
        residuals = [(r / line - 1.0, line) for p, r, d in self._window if (line := self._served(p, int(d))) > 0.0]
        if not residuals:
            return 0.0
        big = SERVED_MARGIN_BIG_STEP * max(line for _, line in residuals)
        worst = max(relative for relative, line in residuals if line >= big)
        return min(SERVED_MAX_MARGIN, max(0.0, worst))

    def _add(self, p: float, r: float, d: float, sign: float) -> None:
        self._sp += sign * p
        self._sr += sign * r
        self._spp += sign * p * p
        self._spr += sign * p * r
        self._sd += sign * d
        self._sdd += sign * d * d
        self._sdp += sign * d * p
        self._sdr += sign * d * r

    def _per_decode(self, n: int) -> float:
        """The per-decode cost of the window's three-term line, its priors included (see above):
        the 2x2 normal equations of the decode and prediction terms about their means."""
        mean_p, mean_r, mean_d = self._sp / n, self._sr / n, self._sd / n
        var_d = max(0.0, self._sdd / n - mean_d * mean_d)
        if var_d <= 0.0:
            return 0.0
        var_p = max(0.0, self._spp / n - mean_p * mean_p)
        cov_dp = self._sdp / n - mean_d * mean_p
        cov_dr = self._sdr / n - mean_d * mean_r
        cov_pr = self._spr / n - mean_p * mean_r
        prior_p = (SERVED_PRIOR_SPREAD * mean_p) ** 2
        prior_d = (SERVED_PRIOR_SPREAD * mean_d) ** 2
        a, b, c = var_d + prior_d, cov_dp, var_p + prior_p
        det = a * c - b * b
        if det <= 0.0:
            return 0.0
        per_decode = (cov_dr * c - b * (cov_pr + prior_p)) / det
        return min(SERVED_MAX_PER_DECODE_S, max(0.0, per_decode))

    def _fit(self) -> tuple[float, float, float]:
        """(fixed, scale, per decode) of the window: the per-decode cost, then on what the steps
        took less it the line shrunk toward the table's own scale, or the summed ratio (see above)."""
        lo, hi = SERVED_FACTOR_BOUNDS
        n = len(self._window)
        per_decode = self._per_decode(n)
        # The window as if every step had taken its decodes' share less.
        sr = self._sr - per_decode * self._sd
        spr = self._spr - per_decode * self._sdp
        mean_p, mean_r = self._sp / n, sr / n
        var_p = max(0.0, self._spp / n - mean_p * mean_p)
        cov = spr / n - mean_p * mean_r
        prior = (SERVED_PRIOR_SPREAD * mean_p) ** 2
        scale = (cov + prior) / (var_p + prior)
        fixed = mean_r - scale * mean_p
        if fixed <= 0.0:
            return 0.0, min(hi, max(lo, sr / self._sp)), per_decode
        if fixed > SERVED_MAX_FIXED_S:
            fixed = SERVED_MAX_FIXED_S
            scale = (mean_r - fixed) / mean_p
        scale = min(hi, max(lo, scale))
        return min(SERVED_MAX_FIXED_S, max(0.0, mean_r - scale * mean_p)), scale, per_decode

    def _served(self, table_s: float, decodes: float, line: tuple[float, ...] | None = None) -> float:
        """A step of `table_s` in the table carrying `decodes` decodes, on `line` (fixed, per
        decode, scale; this model's own by default)."""
        fixed, per_decode, factor = line if line is not None else (self.fixed_s, self.per_decode_s, self.factor)
        return fixed + per_decode * decodes + factor * table_s if table_s > 0.0 else table_s

    def seconds_for(self, decodes: int, prefill_tokens: int, swapped_tokens: int = 0,
                    attention: AttentionLoad | None = None) -> float:
        return self._served(self.model.seconds_for(decodes, prefill_tokens, swapped_tokens, attention=attention),
                            decodes)

    def step_seconds(self, plan: StepPlan) -> float:
        return self._served(self.model.step_seconds(plan), plan_shape(plan, 0)[0])

    def step_seconds_at(self, plan: StepPlan, t: float) -> float:
        """The step's time on the line in force at `t` (line_at); on this model's own line where
        it has no history."""
        return self._served(self.model.step_seconds(plan), plan_shape(plan, 0)[0], self.line_at(t))

    def replayed_seconds(self, plan: StepPlan, t: float | None = None) -> float:
        """What a replay's step takes: a prefill-only step (sequences, none decoding) the table's time
        times the prefill-only ratio where one is known, any other step (a swap-only one too, which the
        engine does not judge) its time on the line (in force at `t`, where given: step_seconds_at)."""
        if self.prefill_only_factor is not None and plan.seqs and plan_shape(plan, 0)[0] == 0:
            table_s = self.model.step_seconds(plan)
            return self.prefill_only_factor * table_s if table_s > 0.0 else table_s
        return self.step_seconds(plan) if t is None else self.step_seconds_at(plan, t)

    def line_at(self, t: float) -> tuple[float, float, float]:
        """(fixed, per decode, scale) in force at `t`: the line history's latest entry at or before
        `t`, the first one before it (the line the first judged steps gave, the best word on the
        steps before them); this model's own line where it has no history."""
        entry = _in_force(self.line_history, t)
        return (self.fixed_s, self.per_decode_s, self.factor) if entry is None else (entry[1], entry[2], entry[3])

    def document_meta(self, origin: float = 0.0) -> dict:
        """What GET /debug/cost-model adds to the table's `meta`; the margin's and the line's
        histories in seconds since `origin` (the engine's clock at its start, which recorded traces
        count from)."""
        history = [[round(max(0.0, t - origin), 3), round(m, 4)] for t, m in self.margin_history]
        lines = [[round(max(0.0, t - origin), 3), round(fixed, 5), round(per_decode, 6), round(factor, 4)]
                 for t, fixed, per_decode, factor in self.line_history]
        return {"servedOverPredicted": round(self.factor, 4), "servedFixedSeconds": round(self.fixed_s, 5),
                "servedPerDecodeSeconds": round(self.per_decode_s, 6), "servedNoiseMargin": round(self.margin, 4),
                "servedMarginHistory": history, "servedLineHistory": lines, "servedSteps": self.steps,
                "servedPrefillOnlyOverPredicted": None if self.prefill_only_factor is None
                else round(self.prefill_only_factor, 4),
                "servedPrefillOnlySteps": self.prefill_only_steps}


def _counted_seconds(predicted_s: float, real_s: float, decodes: int = 0) -> float:
    """What a judged step counts as: a stalled one as at most the line's bounds allow."""
    return min(real_s, SERVED_MAX_FIXED_S + SERVED_MAX_PER_DECODE_S * decodes + SERVED_FACTOR_BOUNDS[1] * predicted_s)


def replay_step_seconds(cost: CostModel, plan: StepPlan, t: float | None = None) -> float:
    """A simulated step's time: a served model's replayed_seconds (at `t` on its dated line, where
    given), any other model's step_seconds."""
    return cost.replayed_seconds(plan, t) if isinstance(cost, ServedCost) else cost.step_seconds(plan)


def margin_at(history: Sequence[tuple[float, float]], t: float) -> float:
    """The margin a history (ServedCost.margin_history) had in force at `t`: its latest entry at or
    before `t`, the first one before it (a learner's margin is 0 until it is first fitted, which
    ServedBound keeps apart; a history cut to its last entries started at the first it kept). An
    empty history is a margin of 0."""
    entry = _in_force(history, t)
    return 0.0 if entry is None else entry[1]


def _in_force(history: Sequence[tuple[float, ...]], t: float) -> tuple[float, ...] | None:
    """A dated history's entry in force at `t` (each entry's first field its time): the latest at
    or before `t`, the first one before it; None for an empty history."""
    if not history:
        return None
    in_force = history[0]
    for entry in history:
        if entry[0] > t:
            break
        in_force = entry
    return in_force


class ServedBound:
    """What the scheduler bounds steps by: a ServedCost's line times (1 + its margin), so a step
    sized to the ITL target keeps it as the window's worst big step did, not on average (see
    SERVED_MARGIN_BIG_STEP). `margin_floor`: a margin the bound keeps at least once the line is
    fitted (a replay's, whose own steps do not scatter: the document's); `cold_margin`: the margin
    it keeps until then (SERVED_COLD_MARGIN). Its `model` is the table, its `served` the line it was
    learned on."""

    def __init__(self, served: ServedCost, margin_floor: float = 0.0, cold_margin: float = 0.0) -> None:
        self.served = served
        self.model = served.model
        self.margin_floor = margin_floor
        self.cold_margin = cold_margin

    @property
    def margin(self) -> float:
        fitted = self.served.steps >= SERVED_MIN_STEPS
        return max(self.served.margin, self.margin_floor) if fitted else self.cold_margin

    @property
    def name(self) -> str:
        return f"{self.served.name} + {self.margin:.0%} margin"

    def seconds_for(self, decodes: int, prefill_tokens: int, swapped_tokens: int = 0,
                    attention: AttentionLoad | None = None) -> float:
        return self.served.seconds_for(decodes, prefill_tokens, swapped_tokens, attention) * (1.0 + self.margin)

    def step_seconds(self, plan: StepPlan) -> float:
        return self.served.step_seconds(plan) * (1.0 + self.margin)


def measured_model(cost: CostModel | None) -> CostModel | None:
    """The model as measured (a ServedCost's or a ServedBound's table; any other model itself)."""
    return cost.model if isinstance(cost, (ServedCost, ServedBound)) else cost


def derivation_model(cost: CostModel | None) -> CostModel | None:
    """The model null limits are derived from: served step times once SERVED_MIN_STEPS served
    steps have been judged (a ServedCost that learned them, or a document that carries them; a
    ServedBound on such a line, whose margin the derived target then carries), else the table as
    measured. A served step pays a fixed cost the calibration's steps did not (on two
    EPYC cores 8.6 ms a step beside the HTTP side and its clients), so limits from the table alone
    take steps too small to be efficient as served: w4a16's table derived 30 tokens and a 31.3 ms
    target, twice budget 64's steps and 0.89 of its throughput (bench/results/derived_defaults.md)."""
    served = cost.served if isinstance(cost, ServedBound) else cost
    if isinstance(served, ServedCost) and served.steps >= SERVED_MIN_STEPS:
        return cost
    return measured_model(cost)


# With no `itlTargetMs`, the chunk is the smallest prefill step that keeps this share of the
# prefill rate (tokens per second) the cost model allows: bigger steps would buy under 10% more
# throughput with a longer stall for every running stream, smaller ones lose throughput quickly on
# hardware whose per-step cost is mostly reading the weights (a CPU at low precision, or a GPU at
# small batches). The rate is judged on straight lines fitted through the prefill-only steps up to
# the one with the best measured rate (a fixed cost per step and a cost per token), not cell by
# cell, and of the least-squares and the Theil-Sen line's choices the smaller step is taken (where
# that lies past the best-rate step at a falling rate, the measured steps decide). Where a step
# costs nearly the same per token at every size (this CPU's w4a16) the intercept is small against
# the cells' noise, so tables of one machine still differ: one day's three derived 738, 449 and
# 256 ms, another day's four 158, 111, 120 and 126 ms (least squares alone: 738, 529, 630 and 158,
# 111, 120, 472; tests/sim/test_cost.py). The target then is what that step costs beside TYPICAL_DECODES
# decodes: derived, not borrowed.
#
# The same share is then asked of the steps streams wait on, a chunk beside TYPICAL_DECODES decodes
# (the decodes alone one point of the line), and the chunk is raised to the size that reaches it,
# within READING_PACE_ITL_MS; a raised chunk is the whole step (budget = chunk). Prefill-only steps
# can have no fixed cost where steps beside decodes do: on two AVX-512 EPYC cores w4a16's prefill
# costs 1.7-1.8 ms a token at every size, and the prefill-only rule's 16-token chunk (budget 27,
# target 53 ms) served 0.78-0.79 of budget 64's throughput on the mixed trace; its steps of about
# 20 prompt tokens and 4 decodes took 58 ms, 3.0 ms a token, against 2.2 ms in budget 64's. Raised
# to 64 it served 0.94-0.98 (bench/results/derived_defaults.md).
PREFILL_EFFICIENCY = 0.9
# Decodes a "typical" step carries when the chunk and the default target are derived (at most maxSequences).
TYPICAL_DECODES = 8
# Floors when even the smallest step misses the target: the engine still makes progress.
MIN_DERIVED_BUDGET = 16
MAX_DERIVED_BUDGET = 65_536
# The default target's ceiling where the chunk is raised for the decodes (efficient_prefill_step): a
# token every 200 ms, 5 a second, about the pace people read at; a stream slower than that is a stall
# its reader sees. It lowers the prefill-only step only where that costs little of its rate
# (PACED_PREFILL_EFFICIENCY, below): fp32 on two cores keeps its 256 tokens, 554 ms.
READING_PACE_ITL_MS = 200.0
# The share of the prefill-only rate the efficient step gives up for reading pace: where that step
# beside the decodes is predicted past READING_PACE_ITL_MS, it is lowered to the largest candidate
# within it (on a served line that puts none within it, the smallest) if that candidate keeps this
# share of the best rate on the table's line (since 2026-12-07 also where a served line judges the
# step: efficient_prefill_step). On two AVX-512 EPYC cores (w4a16-bf16prefill) a served line of
# 7.4 ms + 0.943x the table, fitted during the long-prompt trace, made 192 tokens the efficient step
# and the target 299.6 ms (a chunk at 90% needs 9x the fixed cost's worth of tokens, and 128 kept
# 89% on that line); budget 128 served that trace at the same throughput (103.1 against 102.5
# tok/s, bench/results/derived_defaults.md, 2026-12-05). (A served line's step is now held within
# reading pace where the table's own is smaller: efficient_prefill_step.)
# fp32's small steps keep far less (16 tokens 150 ms, 256 tokens 554 ms), so it keeps its step.
PACED_PREFILL_EFFICIENCY = 0.8
# Prefill step sizes compared for the default target (tokens per step).
EFFICIENT_STEP_CANDIDATES = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048)


@dataclass(frozen=True)
class SchedulerLimits:
    """The token budget, chunk and ITL target a scheduler runs with, and where they came from:
    `set` (all given in the config), `derived` (a null one measured from the cost model), or
    `static` (a null one with no cost model in seconds: STATIC_TOKEN_BUDGET / STATIC_PREFILL_CHUNK)."""

    token_budget: int
    prefill_chunk_size: int
    itl_target_ms: float | None
    source: str
    # Set when the target is out of this hardware's reach: the smallest derived step already misses it.
    warning: str | None = None

    def to_document(self) -> dict:
        return {"tokenBudget": self.token_budget, "prefillChunkSize": self.prefill_chunk_size,
                "itlTargetMs": self.itl_target_ms, "source": self.source}


# How far a derived limit must move before the engine runs with the new one: the served line moves a
# little with every window, and a target that changes each time would make the steps nobody can plan by.
LIMITS_TOLERANCE = 0.1


def limits_moved(old: SchedulerLimits, new: SchedulerLimits, tolerance: float = LIMITS_TOLERANCE) -> bool:
    """Whether any of the budget, chunk and target moved by more than `tolerance` of its old value
    (or the target appeared or went)."""
    if (old.itl_target_ms is None) != (new.itl_target_ms is None):
        return True
    pairs = [(old.token_budget, new.token_budget), (old.prefill_chunk_size, new.prefill_chunk_size)]
    if old.itl_target_ms is not None and new.itl_target_ms is not None:
        pairs.append((old.itl_target_ms, new.itl_target_ms))
    return any(abs(b - a) > tolerance * a for a, b in pairs)


def _judged_sizes(cost: CostModel, candidates: list[int]) -> list[int]:
    """The prefill sizes a model's steps are judged at: a table's measured columns (a served model:
    its table's), other models the candidates."""
    table = measured_model(cost)
    return _columns(table) if isinstance(table, TableCost) else list(candidates)


def _best_rate_size(cost: CostModel, sizes: Sequence[int], decodes: int) -> int:
    """The size whose step beside `decodes` decodes has the best rate (_rates; the smaller on a tie)."""
    rates = _rates(cost, sizes, decodes)
    return max(sizes, key=lambda p: (rates[p], -p))


def _fitted_step_costs(cost: CostModel, candidates: list[int], decodes: int) -> list[tuple[float, float]]:
    """Lines t = a + b p (a: fixed seconds per step, b: seconds per prefill token) through the
    model's times of steps of p prefill tokens beside `decodes` decodes, at a table's measured
    prefill columns (other models: at the candidates), the decodes alone (p = 0) included when
    there are any: least squares, and Theil-Sen (b the median of the slopes between pairs of
    points, a the median of t - b p). Empty when fewer than two points. With a few noisy points
    each can be thrown by one cell: least squares by a slow middle cell (a 64-token cell 60% slow
    derived 64 tokens and a 472 ms target where the same machine's other tables derived 16 tokens
    and 111-158 ms), the medians by a flat last column (a 256-token cell no dearer at any batch, on
    busy cores, pulled them to 192 tokens and 1.4 s).

    Only sizes up to the one with the best rate are fitted: past it a step costs more a token, not
    less (attention grows with the square of a chunk, and a forward may change with its size), so
    those points say nothing of a fixed cost to spread, and on a line they tilt the slope up and the
    fixed cost below zero, which reads as "the smallest step is as efficient". On two AVX2 EPYC
    cores (w4a16-int16) a table of 16, 64 and 256 tokens at 39.7, 87.2 and 649 ms (the 256-token
    chunk past the fused forward's 128 rows) derived a 16-token chunk and a 66 ms target that way,
    and those limits served the mixed and long traces at 0.83 and 0.75 of the best hand-set
    budget, where budget 64 served 0.93 and 1.00 (bench/results/derived_defaults.md, 2026-12-07)."""
    sizes = _judged_sizes(cost, candidates)
    if sizes:
        best = _best_rate_size(cost, sizes, decodes)
        sizes = [p for p in sizes if p <= best]
    if decodes:
        sizes = [0, *sizes]
    points = [(float(p), cost.seconds_for(decodes, p)) for p in sizes]
    if len(points) < 2:
        return []
    mp = sum(p for p, _ in points) / len(points)
    mt = sum(t for _, t in points) / len(points)
    b = sum((p - mp) * (t - mt) for p, t in points) / sum((p - mp) ** 2 for p, _ in points)
    slopes = [(t2 - t1) / (p2 - p1) for i, (p1, t1) in enumerate(points) for p2, t2 in points[i + 1:] if p2 != p1]
    median_b = statistics.median(slopes)
    return [(mt - b * mp, b), (statistics.median(t - median_b * p for p, t in points), median_b)]


def _efficient_threshold(a: float, b: float) -> float:
    """The fewest tokens whose rate on the line t = a + b p, p / (a + b p), is within
    PREFILL_EFFICIENCY of the line's best, 1 / b: E / (1 - E) * a / b (infinite where more tokens
    cost nothing more; 0 where there is no fixed cost)."""
    if b <= 0:
        return math.inf
    return PREFILL_EFFICIENCY / (1.0 - PREFILL_EFFICIENCY) * max(a, 0.0) / b


def _efficient_on_line(a: float, b: float, candidates: list[int]) -> int:
    """The smallest candidate at or past the line's _efficient_threshold (the largest candidate
    when none reaches it)."""
    threshold = _efficient_threshold(a, b)
    return min((c for c in candidates if c >= threshold), default=candidates[-1])


def _rates(cost: CostModel, sizes: Sequence[int], decodes: int = 0) -> dict[int, float]:
    """The rates (prompt tokens per second) of steps of each size beside `decodes` decodes, as
    `cost` predicts them (a served model: with what served steps add)."""
    return {p: p / max(cost.seconds_for(decodes, p), 1e-9) for p in sizes}


def _efficient_by_rate(cost: CostModel, sizes: Sequence[int], decodes: int = 0) -> int:
    """The smallest size whose rate (_rates) is at least PREFILL_EFFICIENCY of the best size's."""
    rates = _rates(cost, sizes, decodes)
    best = max(rates.values())
    return min(p for p, r in rates.items() if r >= PREFILL_EFFICIENCY * best)


def _columns(table: TableCost) -> list[int]:
    return [int(p) for p in table.prefill_tokens if p > 0]


def efficient_step_past_table(table: TableCost) -> bool:
    """Whether a table's prefill columns end before the efficient prefill-only step: on both lines
    fitted through its prefill-only cells up to the best rate (_fitted_step_costs) a step of its largest column is
    still short of PREFILL_EFFICIENCY of the line's best rate, and the cells agree: the column
    before the last reaches less than that share of the last one's rate. The default target is
    judged only within the measured columns (efficient_prefill_step), so such a table would pin it
    to the last column whatever the steps past it cost; the engine's calibration measures wider
    columns while this holds (runner/calibration.py, CALIBRATION_WIDEST_PREFILL). False with
    fewer than two prefill-only cells (nothing to fit)."""
    fits = _fitted_step_costs(table, [], 0)
    rates = list(_rates(table, _columns(table)).values())
    top = max(table.prefill_tokens)
    return (bool(fits) and all(_efficient_threshold(a, b) > top for a, b in fits)
            and rates[-2] < PREFILL_EFFICIENCY * rates[-1])


def _prefill_efficiency(cost: CostModel, candidates: list[int], chunk: int) -> float:
    """A prefill-only step's rate as a share of the best on the fitted lines (the larger of the
    two lines' shares, as _prefill_step takes the smaller of their steps), else of the candidates'.
    A line's best is where its fixed cost vanishes, past the sizes it was fitted through: even the
    best measured size may keep less than 1 of it."""
    fits = _fitted_step_costs(cost, candidates, 0)
    if fits:
        return max(1.0 if b <= 0 else chunk / (chunk + max(a, 0.0) / b) for a, b in fits)
    return _rates(cost, [chunk])[chunk] / max(_rates(cost, candidates).values())


def _prefill_step(cost: CostModel, candidates: list[int], decodes: int) -> int:
    """The smallest candidate chunk whose rate beside `decodes` decodes, on a fitted line
    (_fitted_step_costs, _efficient_on_line), is at least PREFILL_EFFICIENCY of the line's best,
    the smaller of the two lines' choices; where no line fits, the candidates' own rates."""
    fits = _fitted_step_costs(cost, candidates, decodes)
    if fits:
        # Where the two lines disagree, the smaller step: too big a chunk stalls every running
        # stream for longer, too small a one gives up at most the efficiency margin's throughput.
        step = min(_efficient_on_line(a, b, candidates) for a, b in fits)
        # The lines end at the best rate; past it they promise a rate the steps do not keep. Where
        # the lines' step lies there at under PREFILL_EFFICIENCY of the best size's rate, the
        # measured sizes decide (a w4a16-int16 table of this CPU class with its 16-token cell 20%
        # slower put the lines' step at 192 tokens, 0.70 of 64's rate, and the target at 710 ms).
        sizes = _judged_sizes(cost, candidates)
        best = _best_rate_size(cost, sizes, decodes)
        rates = _rates(cost, [step, best], decodes)
        if step > best and rates[step] < PREFILL_EFFICIENCY * rates[best]:
            return _efficient_by_rate(cost, [p for p in sizes if p >= candidates[0]] or candidates, decodes)
        return step
    return _efficient_by_rate(cost, candidates, decodes)


def _prefill_only_step(cost: CostModel, candidates: list[int], columns: list[int]) -> int:
    """The efficient prefill-only step (_prefill_step with no decodes); where that is the last
    candidate, the smallest of the table's measured `columns` (those of at least the first
    candidate's tokens) within PREFILL_EFFICIENCY of the best such column's rate."""
    chunk = _prefill_step(cost, candidates, 0)
    if chunk == candidates[-1] and len(columns) > 1:
        # The lines put the step at (or past) the largest candidate within the table; a line's best
        # rate is where its fixed cost vanishes, but attention grows with the square of a chunk, so
        # measured rates level off first. The measured columns decide: on two Xeon cores with AMX
        # (bf16) the lines through 16 ... 1,024 tokens put 90% of their best past 600 tokens, while
        # 512 tokens already ran at 96% of 1,024's measured rate (runner/calibration.py).
        chunk = min(chunk, _efficient_by_rate(cost, columns))
    return chunk


def efficient_prefill_step(cost: CostModel, max_sequences: int) -> tuple[int, float, bool]:
    """The default chunk, the ITL target in ms, and whether the chunk was raised for the decodes.
    The chunk: the efficient prefill-only step (_prefill_only_step; on a served model no bigger than
    the table's own, or than the largest candidate within reading pace beside d decodes where that is
    bigger: see the comment in the body), lowered to the largest candidate predicted within
    READING_PACE_ITL_MS beside d decodes where it is past that and the candidate keeps
    PACED_PREFILL_EFFICIENCY of the rate (_prefill_efficiency), raised where steps beside
    d = min(maxSequences, TYPICAL_DECODES) decodes are efficient only at a bigger size, to that size,
    but not past the largest candidate whose step beside the d decodes is predicted within
    READING_PACE_ITL_MS (on a ServedBound, by its line: what the step takes). The target: the
    predicted time of the chunk beside the d decodes (on a ServedBound, its margin included), rounded
    up to 0.1 ms so the step it was chosen for fits the bound."""
    table = measured_model(cost)
    top = max(table.prefill_tokens) if isinstance(table, TableCost) else MAX_DERIVED_BUDGET
    candidates = [c for c in EFFICIENT_STEP_CANDIDATES if c <= max(top, MIN_DERIVED_BUDGET)]
    d = min(max_sequences, TYPICAL_DECODES)
    columns = [p for p in _columns(table) if p >= candidates[0]] if isinstance(table, TableCost) else []
    chunk = _prefill_only_step(cost, candidates, columns)
    # The pace is judged on what steps take (a bound's line), the target promised on the bound: a
    # margin for the steps' scatter scales every step alike, so the chunk it is judged on is the same.
    pace = cost.served if isinstance(cost, ServedBound) else cost
    paced = [c for c in candidates if pace.seconds_for(d, c) * 1000.0 <= READING_PACE_ITL_MS]
    if cost is not table:
        # A served line raises the table's prefill-only step only within reading pace. Its fixed cost
        # is fitted from steps whose sizes hardly differ (an ITL bound keeps them alike), so a slow
        # phase of a shared host, which stretches every step, comes out as a fixed cost of up to
        # SERVED_MAX_FIXED_S, and on such a line only big prefill-only steps look efficient: on two
        # AVX2 EPYC cores (w4a16), whose table derives 64 tokens and 163 ms, one mixed-trace run
        # derived 192 tokens and a 735.9 ms target again from served steps, and its streams' ITL p50
        # was 0.40 s (bench/results/derived_defaults.md, 2026-12-06).
        chunk = min(chunk, max(_prefill_only_step(table, candidates, columns), max(paced, default=0)))
    # The step nearest reading pace: the largest within it; on a served line that puts none within
    # it (a slow phase, above, up to SERVED_FACTOR_BOUNDS' slowest), the smallest. What that step
    # gives up is judged on the table: on the served line every small step looks dear.
    nearest = max(paced) if paced else candidates[0] if cost is not table else None
    if nearest is not None and chunk > nearest \
            and _prefill_efficiency(table, candidates, nearest) >= PACED_PREFILL_EFFICIENCY:
        chunk = nearest
    beside_decodes = min(_prefill_step(cost, candidates, d), max(paced, default=chunk))
    raised = beside_decodes > chunk
    chunk = max(chunk, beside_decodes)
    return chunk, ceil_target_ms(cost.seconds_for(d, chunk)), raised


def ceil_target_ms(seconds: float) -> float:
    """A derived ITL target in ms: `seconds` rounded up to 0.1 ms, so the step it was derived from
    still fits (within a float's rounding)."""
    return math.ceil(seconds * 10_000.0 - 1e-6) / 10.0


def derive_scheduler_limits(sp: SchedulerPolicy, cost: CostModel | None) -> SchedulerLimits:
    """Fill a null `tokenBudget` / `prefillChunkSize` from a cost model in seconds and the ITL
    target: `itlTargetMs`, else the cost of an efficient step (efficient_prefill_step), on
    derivation_model(cost): served step times once enough are judged, else the table. The budget is
    the largest step of prefill tokens predicted within the target, the chunk what a step with
    TYPICAL_DECODES decodes leaves; with neither set nor a target, where efficient_prefill_step
    raised its step for the decodes, both are that step. Explicit values win. When anything is
    derived, or `itlTargetMs` is set, the limits carry the target, and the scheduler bounds each
    step's total predicted time by it."""
    derive = sp.token_budget is None or sp.prefill_chunk_size is None
    cost = derivation_model(cost)
    if cost is None or isinstance(cost, UnitCost):
        if sp.itl_target_ms is not None:
            raise CostModelError("scheduler.itlTargetMs needs a cost model in seconds (measured, a table or linear), "
                                 "not " + ("none" if cost is None else "the unit model, which counts steps"))
        budget = sp.token_budget if sp.token_budget is not None else STATIC_TOKEN_BUDGET
        chunk = sp.prefill_chunk_size if sp.prefill_chunk_size is not None else min(STATIC_PREFILL_CHUNK, budget)
        return SchedulerLimits(budget, chunk, None, "static" if derive else "set")
    target_ms = sp.itl_target_ms
    budget = sp.token_budget
    chunk = sp.prefill_chunk_size
    if target_ms is None and derive:
        step, target_ms, raised = efficient_prefill_step(cost, sp.max_sequences)
        if raised and budget is None and chunk is None:
            # The step raised for the decodes is the whole step, decodes included: a budget from
            # the target would admit prefill-only steps past it (64 -> 75 tokens on w4a16, out of
            # the fused forward's chunk rows: 0.86 of budget 64's throughput against 0.94).
            budget = chunk = step
    target_s = (target_ms or 0.0) / 1000.0
    if budget is None:
        budget = max(MIN_DERIVED_BUDGET, largest_fitting(lambda b: cost.seconds_for(0, b) <= target_s, MAX_DERIVED_BUDGET))
    if chunk is None:
        d = min(sp.max_sequences, TYPICAL_DECODES, max(0, budget - 1))
        chunk = max(min(MIN_DERIVED_BUDGET, budget),
                    largest_fitting(lambda p: cost.seconds_for(d, p) <= target_s, budget - d))
    floor = cost.seconds_for(0, MIN_DERIVED_BUDGET)
    warning = None
    if derive and floor > target_s:
        warning = (f"a step of {MIN_DERIVED_BUDGET} prefill tokens is predicted at {floor * 1000:.0f} ms, over the "
                   f"{target_ms:g} ms ITL target: the derived limits sit at their floor")
    return SchedulerLimits(budget, min(chunk, budget), target_ms, "derived" if derive else "set", warning)


def apply_limits(config: EngineConfig, limits: SchedulerLimits) -> EngineConfig:
    """The config with the limits written in (what the scheduler then runs with)."""
    update = {"token_budget": limits.token_budget, "prefill_chunk_size": limits.prefill_chunk_size,
              "itl_target_ms": limits.itl_target_ms}
    return config.model_copy(update={"scheduler": config.scheduler.model_copy(update=update)})


def load_cost_model(spec: str, block_size: int = 16) -> CostModel:
    """`unit`, `linear`, or a JSON file (linear constants or a profile table)."""
    if spec == "unit":
        return UnitCost()
    if spec == "linear":
        return LinearCost(block_size=block_size)
    return cost_model_from_document(read_cost_document(spec), spec, block_size)


def read_cost_document(spec: str) -> dict:
    """The JSON object in a cost-model file."""
    path = Path(spec)
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise CostModelError(f"--cost-model {spec}: not 'unit', 'linear' or a readable JSON file ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise CostModelError(f"{spec}: not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise CostModelError(f"{spec}: expected a JSON object")
    return doc


def builtin_document(cost: CostModel) -> dict:
    """The document form of a built-in model (what `/debug/cost-model` returns for it)."""
    if isinstance(cost, UnitCost):
        return {"kind": "unit"}
    return {"kind": cost.name, **{f.name: getattr(cost, f.name) for f in fields(cost) if f.name != "name"}}


def _served_seconds(meta: dict, key: str, most: float, spec: str) -> float:
    """A served line's figure (seconds, or the margin's share) from a document's meta (0 when absent:
    documents from before the term)."""
    value = meta.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= most:
        raise CostModelError(f"{spec}: meta.{key}: expected a number in [0, {most}], got {value!r}")
    return float(value)


def _dated_history(value: object, spec: str, key: str, bounds: Sequence[tuple[str, float, float]],
                   most: int) -> tuple[tuple[float, ...], ...]:
    """`meta.<key>`: at most `most` lists [seconds, value, ...], seconds >= 0 and not decreasing,
    each value within its (name, low, high) in `bounds`."""
    def number(x: object) -> bool:
        return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)

    names = ", ".join(name for name, _, _ in bounds)
    ranges = ", ".join(f"{name} in [{lo}, {hi}]" for name, lo, hi in bounds)
    what = (f"{spec}: meta.{key}: expected at most {most} [seconds, {names}] lists, seconds >= 0 and not "
            f"decreasing, {ranges}")
    if not isinstance(value, list) or len(value) > most:
        raise CostModelError(f"{what}, got {value!r:.200}")
    entries: list[tuple[float, ...]] = []
    for entry in value:
        ok = isinstance(entry, list) and len(entry) == 1 + len(bounds) and all(number(x) for x in entry)
        if not ok or entry[0] < (entries[-1][0] if entries else 0.0) or not all(
                lo <= x <= hi for x, (_, lo, hi) in zip(entry[1:], bounds)):
            raise CostModelError(f"{what}, got {entry!r:.200}")
        entries.append(tuple(float(x) for x in entry))
    return tuple(entries)


def _margin_history(value: object, spec: str) -> tuple[tuple[float, float], ...]:
    """`meta.servedMarginHistory`: [seconds, margin] pairs, margins in [0, SERVED_MAX_MARGIN]."""
    return _dated_history(value, spec, "servedMarginHistory", [("margin", 0.0, SERVED_MAX_MARGIN)],
                          SERVED_MARGIN_HISTORY)  # type: ignore[return-value]


def _line_history(value: object, spec: str) -> tuple[tuple[float, float, float, float], ...]:
    """`meta.servedLineHistory`: [seconds, fixed, per decode, scale] lists within the line's own bounds."""
    return _dated_history(value, spec, "servedLineHistory",
                          [("fixed", 0.0, SERVED_MAX_FIXED_S), ("per decode", 0.0, SERVED_MAX_PER_DECODE_S),
                           ("scale", *SERVED_FACTOR_BOUNDS)], SERVED_LINE_HISTORY)  # type: ignore[return-value]


def cost_model_from_document(doc: dict, spec: str = "cost model", block_size: int = 16) -> CostModel:
    """A cost model from its document (`magnitude profile`'s file, the engine's calibration)."""
    doc = dict(doc)
    kind = doc.pop("kind", "table" if "seconds" in doc else "linear")
    if kind == "unit" and not set(doc) - {"meta"}:
        return UnitCost()
    meta = doc.pop("meta", None) or {}
    served = meta.get("servedOverPredicted") if isinstance(meta, dict) else None
    if served is not None:
        lo, hi = SERVED_FACTOR_BOUNDS
        if isinstance(served, bool) or not isinstance(served, (int, float)) or not lo <= served <= hi:
            raise CostModelError(f"{spec}: meta.servedOverPredicted: expected a number in [{lo}, {hi}], got {served!r}")
        steps = meta.get("servedSteps", 0)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise CostModelError(f"{spec}: meta.servedSteps: expected a count, got {steps!r}")
        fixed = _served_seconds(meta, "servedFixedSeconds", SERVED_MAX_FIXED_S, spec)
        per_decode = _served_seconds(meta, "servedPerDecodeSeconds", SERVED_MAX_PER_DECODE_S, spec)
        margin = _served_seconds(meta, "servedNoiseMargin", SERVED_MAX_MARGIN, spec)
        history = _margin_history(meta.get("servedMarginHistory", []), spec)
        lines = _line_history(meta.get("servedLineHistory", []), spec)
        prefill_only = meta.get("servedPrefillOnlyOverPredicted")
        if prefill_only is not None and (isinstance(prefill_only, bool) or not isinstance(prefill_only, (int, float))
                                         or not lo <= prefill_only <= hi):
            raise CostModelError(f"{spec}: meta.servedPrefillOnlyOverPredicted: expected null or a number in "
                                 f"[{lo}, {hi}], got {prefill_only!r}")
        prefill_only_steps = meta.get("servedPrefillOnlySteps", 0)
        if isinstance(prefill_only_steps, bool) or not isinstance(prefill_only_steps, int) or prefill_only_steps < 0:
            raise CostModelError(f"{spec}: meta.servedPrefillOnlySteps: expected a count, got {prefill_only_steps!r}")
        return ServedCost(cost_model_from_document({**doc, "kind": kind}, spec, block_size), float(served), steps,
                          fixed, per_decode, margin, history, lines,
                          None if prefill_only is None else float(prefill_only), prefill_only_steps)
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
