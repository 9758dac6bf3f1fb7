"""Served step times (`sim/cost.py ServedCost`): the engine learns what its steps really take
against the table and how far they scatter about that line, an ITL target (explicit or derived) is then
kept on served times with a margin for the scatter (ServedBound), derived limits follow the served times
once enough steps are judged (the table's before), and a document from `GET /debug/cost-model` replays
with the served line and margin."""

from __future__ import annotations

import json

import pytest

from magnitude.policy.load import resolve_config
from magnitude.sim.cost import (SERVED_COLD_MARGIN, SERVED_DERIVE_STEPS, SERVED_EARLY_STEPS, SERVED_FACTOR_BOUNDS, SERVED_MARGIN_EVERY,
                                SERVED_LINE_HISTORY, SERVED_LINE_HISTORY_STEP, SERVED_MARGIN_HISTORY, SERVED_MARGIN_HISTORY_STEP,
                                SERVED_MAX_FIXED_S, SERVED_MAX_MARGIN, SERVED_MAX_PER_DECODE_S, SERVED_MIN_STEPS,
                                SERVED_PRIOR_SPREAD, SERVED_WINDOW, CostModelError, SchedulerLimits, ServedBound, ServedCost, TableCost,
                                READING_PACE_ITL_MS, cost_model_from_document, derivation_model, derive_scheduler_limits,
                                _prefill_step, limits_moved, margin_at)
from magnitude.sim.served_limits import LimitsFollower
from magnitude.sim.report import build_report
from magnitude.sim.simulate import simulate

# The ITL-bound tests' calibration-shaped table and trace (test modules of tests/sim import as top-level names).
from test_itl_bound import MEASURED, decoding_steps, documents  # noqa: E402


def table_document(**meta) -> dict:
    doc = {"kind": "table", "decode_batch_sizes": list(MEASURED.decode_batch_sizes),
           "prefill_tokens": list(MEASURED.prefill_tokens), "seconds": [list(r) for r in MEASURED.seconds]}
    return {**doc, "meta": meta} if meta else doc


def test_served_steps_are_a_fixed_cost_plus_a_scale_of_the_table() -> None:
    """The window's least-squares line, real = fixed + scale x predicted: what the engine adds to every
    step (its loop, and the HTTP side on the same cores), which weighs most on the small ones. The
    slope is shrunk toward the table's 1x by a prior worth a spread of SERVED_PRIOR_SPREAD of the mean
    prediction; a window spread as a mixed trace's steps (5-100 ms) keeps most of its own slope."""
    served = ServedCost(MEASURED, 1.3)  # a document's model holds until SERVED_EARLY_STEPS are seen
    sizes = [0.005 + 0.005 * (i % 20) for i in range(SERVED_WINDOW)]  # 5-100 ms, as a mixed trace's steps
    for p in sizes[:SERVED_EARLY_STEPS - 1]:
        served.observe(p, 0.008 + 1.05 * p)
    assert (served.factor, served.fixed_s) == (1.3, 0.0)
    # Then, until SERVED_MIN_STEPS, the ratio of the summed seconds, with no fixed cost.
    for p in sizes[SERVED_EARLY_STEPS - 1:SERVED_MIN_STEPS - 1]:
        served.observe(p, 0.008 + 1.05 * p)
    seen = sizes[:SERVED_MIN_STEPS - 1]
    assert served.factor == pytest.approx(sum(0.008 + 1.05 * p for p in seen) / sum(seen)) and served.fixed_s == 0.0
    for p in sizes[SERVED_MIN_STEPS - 1:]:
        served.observe(p, 0.008 + 1.05 * p)
    n = len(sizes)
    mean_p = sum(sizes) / n
    var_p = sum(p * p for p in sizes) / n - mean_p ** 2
    prior = (SERVED_PRIOR_SPREAD * mean_p) ** 2
    scale = (1.05 * var_p + prior) / (var_p + prior)  # 1.041: the line's 1.05 shrunk toward 1
    assert served.factor == pytest.approx(scale) and 1.03 < scale < 1.05
    assert served.fixed_s == pytest.approx(0.008 + (1.05 - scale) * mean_p)
    assert served.seconds_for(4, 64) == pytest.approx(served.fixed_s + scale * MEASURED.seconds_for(4, 64))
    assert f"{scale:.3f} + {served.fixed_s * 1000:.1f} ms served" in served.name
    # A step predicted at nearly nothing is not judged; a stall counts as at most the bounds allow.
    served.observe(1e-5, 1.0)
    assert served.steps == SERVED_WINDOW
    stalled = ServedCost(MEASURED)
    for _ in range(SERVED_MIN_STEPS):
        stalled.observe(0.010, 5.0)
    assert (stalled.fixed_s, stalled.factor) == (SERVED_MAX_FIXED_S, pytest.approx(SERVED_FACTOR_BOUNDS[1]))
    # One 5 s stall among the line's steps weighs as a step of SERVED_MAX_FIXED_S + 4x its prediction.
    stall, capped = ServedCost(MEASURED), ServedCost(MEASURED)
    for p in sizes[:-1]:
        stall.observe(p, 0.008 + 1.05 * p)
        capped.observe(p, 0.008 + 1.05 * p)
    stall.observe(0.050, 5.0)
    capped.observe(0.050, SERVED_MAX_FIXED_S + SERVED_FACTOR_BOUNDS[1] * 0.050)
    assert (stall.fixed_s, stall.factor) == (pytest.approx(capped.fixed_s), pytest.approx(capped.factor))
    assert stall.factor < 1.2


def test_where_a_line_says_nothing_the_excess_is_a_fixed_cost() -> None:
    # Steps of one size: no slope to fit; the table's scale, and what they took beyond it a fixed
    # cost (only the last SERVED_WINDOW steps count), so bigger steps are predicted to amortize it.
    served = ServedCost(MEASURED)
    for _ in range(SERVED_WINDOW):
        served.observe(0.010, 0.050)
    for _ in range(SERVED_WINDOW):
        served.observe(0.010, 0.020)
    assert (served.fixed_s, served.factor) == (pytest.approx(0.010), pytest.approx(1.0))
    # Beyond the fixed cost's cap the rest is a scale.
    for _ in range(SERVED_WINDOW):
        served.observe(0.010, 0.080)
    assert (served.fixed_s, served.factor) == (SERVED_MAX_FIXED_S, pytest.approx(3.0))
    # Steps faster than the table: the ratio, a small step is never free.
    for _ in range(SERVED_WINDOW):
        served.observe(0.010, 0.008)
    assert (served.fixed_s, served.factor) == (0.0, pytest.approx(0.8))
    # A line that would give steps a negative fixed cost: the ratio, so a small step is never free.
    for p in (0.010, 0.100) * (SERVED_WINDOW // 2):
        served.observe(p, 1.5 * p - 0.005)
    assert served.fixed_s == 0.0 and served.factor == pytest.approx((1.5 * 0.110 - 0.010) / 0.110)
    # The scale stays within its bounds, the fixed cost within its own.
    for _ in range(SERVED_WINDOW):
        served.observe(0.010, 0.001)
    assert (served.fixed_s, served.factor) == (0.0, SERVED_FACTOR_BOUNDS[0])
    for p in (0.010, 0.020) * (SERVED_WINDOW // 2):
        served.observe(p, 0.045 + 0.2 * p)
    assert served.factor == SERVED_FACTOR_BOUNDS[0] and 0.0 < served.fixed_s <= SERVED_MAX_FIXED_S


@pytest.mark.parametrize("slope", [0.5, 1.5])
def test_the_fit_does_not_jump_where_the_window_starts_to_spread(slope: float) -> None:
    """Windows of nearly the same spread fit nearly the same line: the table's scale is a prior, not
    a switch at SERVED_PRIOR_SPREAD (a switch fitted 1x + the excess on one side and the bare line
    on the other, and a step twice the window's mean was predicted 25% apart)."""
    def fitted(spread: float) -> ServedCost:
        served = ServedCost(MEASURED)
        for p in (0.040 * (1 - spread), 0.040 * (1 + spread)) * (SERVED_WINDOW // 2):
            served.observe(p, 0.030 + slope * p)
        return served
    below, above = fitted(0.24 * SERVED_PRIOR_SPREAD / 0.25), fitted(0.26 * SERVED_PRIOR_SPREAD / 0.25)
    assert below.fixed_s > 0.0 and above.fixed_s > 0.0
    big = 0.080  # twice the mean prediction
    assert below.fixed_s + below.factor * big == pytest.approx(above.fixed_s + above.factor * big, rel=0.02)
    # Both lie between the table's scale and the window's own slope.
    assert min(1.0, slope) < below.factor < max(1.0, slope) and min(1.0, slope) < above.factor < max(1.0, slope)


def _window(per_decode_s: float, decodes) -> list[tuple[float, float, int]]:
    """A mixed trace's window: steps of 5-100 ms carrying `decodes(i)` decodes, each served at 4 ms +
    `per_decode_s` a decode + 1.1x its prediction."""
    out = []
    for i in range(SERVED_WINDOW):
        p, d = 0.005 + 0.005 * (i % 20), decodes(i)
        out.append((p, 0.004 + per_decode_s * d + 1.1 * p, d))
    return out


def test_what_each_decode_adds_is_learned_where_the_decode_counts_differ() -> None:
    """Served steps pay per stream they produce a token for (booking, detokenizing, streaming it):
    where the window's steps carry from 1 to 24 decodes, the three-term line finds that share, near
    the window's own (the prior of 0 shrinks it a little), and a step without decodes is not charged
    it. The two-term line takes it as a fixed cost every step pays."""
    window = _window(0.0008, lambda i: 1 + (7 * i) % 24)
    three, two = ServedCost(MEASURED), ServedCost(MEASURED)
    for p, r, d in window:
        three.observe(p, r, d)
        two.observe(p, r)  # decodes unknown: the two-term line
    print(f"\nthree-term: {three.name}; two-term: {two.name}")
    assert 0.0006 < three.per_decode_s < 0.0008  # the prior shrinks it a little
    assert three.factor == pytest.approx(1.1, abs=0.02)
    assert three.fixed_s < 0.008 < two.fixed_s  # the two-term line charges 12.5 decodes' share to every step
    assert three.seconds_for(0, 256) < two.seconds_for(0, 256)
    busy = three.seconds_for(24, 64) - three.seconds_for(0, 64) - three.factor * (MEASURED.seconds_for(24, 64)
                                                                                    - MEASURED.seconds_for(0, 64))
    assert busy == pytest.approx(24 * three.per_decode_s)
    assert "ms a decode served" in three.name and "a decode" not in two.name
    # Bounded like the fixed cost.
    capped = ServedCost(MEASURED)
    for p, r, d in _window(0.02, lambda i: 1 + (7 * i) % 24):
        capped.observe(p, r, d)
    assert capped.per_decode_s == SERVED_MAX_PER_DECODE_S


def test_where_every_step_carries_the_same_decodes_their_share_is_the_fixed_cost() -> None:
    # The 24-request burst's steps, all 24 decodes: a decode's share cannot be told from the fixed
    # cost, so the line is the two-term one exactly.
    same, two = ServedCost(MEASURED), ServedCost(MEASURED)
    for p, r, d in _window(0.0008, lambda i: 24):
        same.observe(p, r, d)
        two.observe(p, r)
    assert same.per_decode_s == 0.0
    assert (same.fixed_s, same.factor) == (pytest.approx(two.fixed_s), pytest.approx(two.factor))
    # 23 or 24 decodes: a spread of 0.5 against the prior's 6 (25% of 23.5), so the share stays almost
    # all in the fixed cost (the window's own line would put 0.89 ms on each decode).
    nearly, two = ServedCost(MEASURED), ServedCost(MEASURED)
    for p, r, d in _window(0.0008, lambda i: 23 + i % 2):
        nearly.observe(p, r, d)
        two.observe(p, r)
    assert nearly.per_decode_s < 1e-4
    assert (nearly.fixed_s, nearly.factor) == (pytest.approx(two.fixed_s, rel=0.05), pytest.approx(two.factor, rel=0.01))


def test_the_follower_judges_each_step_with_the_decodes_it_carried() -> None:
    """LimitsFollower hands ServedCost each judged step's decodes: steps of 1-16 decodes, some beside
    a prompt chunk, that wait 2 ms a decode more than the table teach the served line that share."""
    from magnitude.engine.output import ScheduledSeq, StepPlan
    from magnitude.engine.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    follower = LimitsFollower(resolve_config(None, ["scheduler.itlTargetMs=150"]).scheduler, MEASURED)
    start = 0.0
    for i in range(SERVED_WINDOW):
        d = 1 + (5 * i) % 16
        chunk = 16 * ((3 * i) % 5)  # 0-64 prompt tokens, not in step with the decodes
        seqs = [ScheduledSeq(f"r{j}", [1], 200, [j], True, greedy) for j in range(d)]
        plan = StepPlan(i, seqs + ([ScheduledSeq("p", [1] * chunk, 0, [99], True, greedy)] if chunk else []))
        follower.after_step(plan, start, decoding=True)
        start += MEASURED.step_seconds(plan) + 0.002 * d
    served = follower.served
    print(f"\n{served.name}")
    # Most of the share goes per decode (the priors keep some in the scale and the fixed cost; a
    # follower that passed no decodes would learn none), and a busy step is predicted as it waits.
    assert 0.001 < served.per_decode_s <= 0.002
    busy = StepPlan(0, [ScheduledSeq(f"r{j}", [1], 200, [j], True, greedy) for j in range(16)])
    assert served.step_seconds(busy) == pytest.approx(MEASURED.step_seconds(busy) + 0.032, rel=0.05)


def test_a_decode_share_keeps_prefill_only_steps_efficient_and_the_target_near() -> None:
    """The burst's served line with the decodes' share as a fixed cost made prefill-only steps look
    dear: the efficient step and the target grew with it. Learned per decode, prefill-only steps keep
    their own cost, so the limits stay those of the machine, not of how many streams it served."""
    sp = resolve_config(None, []).scheduler
    three = ServedCost(PROPORTIONAL, steps=SERVED_DERIVE_STEPS)
    two = ServedCost(PROPORTIONAL, steps=SERVED_DERIVE_STEPS)
    for p, r, d in _window(0.002, lambda i: 1 + (7 * i) % 24):  # 2 ms a decode: 25 ms at the mean
        three.observe(p, r, d)
        two.observe(p, r)
    by_decode, by_step = derive_scheduler_limits(sp, three), derive_scheduler_limits(sp, two)
    print(f"\n{three.name}: {by_decode}\n{two.name}: {by_step}")
    # The fixed-only line makes every step pay the decodes' share, so only big prefill-only steps look
    # efficient (192 tokens, past reading pace beside 8 decodes), and reading pace takes it back to 128.
    assert _prefill_step(two, [16, 32, 48, 64, 96, 128, 192, 256], 0) >= 192
    assert by_step.prefill_chunk_size == 128 and by_step.itl_target_ms <= READING_PACE_ITL_MS
    # Per decode, the step is the one efficient beside 8 decodes, within reading pace, and the target
    # what it costs there, less than the fixed-only line charges.
    assert by_decode.prefill_chunk_size <= by_step.prefill_chunk_size
    assert by_decode.itl_target_ms < by_step.itl_target_ms <= READING_PACE_ITL_MS


# The w4a16 table two AVX2 EPYC cores calibrated (2026-12-06 09:03, 2 threads): prefill costs about
# the same per token at every size, so the table derives 64 tokens and a 163.1 ms target.
EPYC_AVX2_W4A16 = TableCost(decode_batch_sizes=(0.0, 1.0, 4.0, 16.0), prefill_tokens=(0.0, 16.0, 64.0, 256.0),
                            seconds=((1e-6, 0.03526, 0.12120, 0.55757), (0.00997, 0.04031, 0.13499, 0.55757),
                                     (0.01491, 0.04981, 0.14364, 0.61203), (0.05266, 0.07784, 0.20180, 0.64466)))


@pytest.mark.parametrize("factor", [0.8, 1.0, 1.34, 2.0, 3.0, 4.0])
def test_a_slow_phase_fitted_as_a_fixed_cost_does_not_raise_the_step_past_reading_pace(factor) -> None:
    """A slow phase of a shared host stretches every step, and a line fitted through steps of about
    one size puts that in its fixed cost, up to SERVED_MAX_FIXED_S. Judged on such a line, only big
    prefill-only steps looked efficient: the engine on these cores derived 192 tokens and a 735.9 ms
    target again from served steps. A served line raises the table's prefill-only step only within
    reading pace, and the target carries the margin. Where even 16 tokens beside 8 decodes are past
    reading pace (from about 2.6x with the fixed cost), the step is the smallest: the table's own
    prefill-only step (48 tokens) would double the target (460-522 ms at 2.6-3x)."""
    sp = resolve_config(None, []).scheduler
    table = derive_scheduler_limits(sp, EPYC_AVX2_W4A16)
    assert (table.token_budget, table.prefill_chunk_size) == (64, 64)
    served = ServedBound(ServedCost(EPYC_AVX2_W4A16, factor, SERVED_DERIVE_STEPS, SERVED_MAX_FIXED_S, margin=0.2))
    limits = derive_scheduler_limits(sp, served)
    print(f"\n{served.name}: {limits}")
    assert limits.prefill_chunk_size <= table.prefill_chunk_size
    if factor <= 2.0:
        assert limits.itl_target_ms <= READING_PACE_ITL_MS * 1.2 + 0.1
    else:
        assert limits.prefill_chunk_size == 16


# A table whose steps cost in proportion to their tokens (1 ms each, decodes and prefill alike), as
# this CPU's w4a16 table nearly does: prefill-only steps have no fixed cost, so 16 tokens are already
# efficient alone; beside 8 decodes (8 ms a step whatever the chunk) 90% of the rate takes 72+.
_ROWS, _COLS = (0.0, 1.0, 4.0, 16.0), (0.0, 16.0, 64.0, 256.0)
PROPORTIONAL = TableCost(decode_batch_sizes=_ROWS, prefill_tokens=_COLS,
                         seconds=tuple(tuple(max(1e-6, 0.001 * (d + p)) for p in _COLS) for d in _ROWS))


def test_limits_follow_served_steps_once_enough_are_judged() -> None:
    sp = resolve_config(None, []).scheduler
    table = derive_scheduler_limits(sp, PROPORTIONAL)
    # Raised for the decodes to 96 tokens (the next candidate), the whole step, within reading pace.
    assert table == SchedulerLimits(96, 96, 104.0, "derived")
    # Until SERVED_MIN_STEPS served steps are judged (the line is fitted), the table (a few steps say little).
    young = ServedCost(PROPORTIONAL, 1.0, SERVED_MIN_STEPS - 1, 0.008)
    assert derivation_model(young) is PROPORTIONAL and derive_scheduler_limits(sp, young) == table
    # Then each served step pays 8 ms the table left out: beside 8 decodes (16 ms a step) 90% of the
    # rate takes 144+ tokens (the candidates: 192; reading pace allows 128), and the target is that
    # step beside 8 decodes as served.
    served = ServedCost(PROPORTIONAL, 1.0, SERVED_MIN_STEPS, 0.008)
    assert derivation_model(served) is served
    assert derive_scheduler_limits(sp, served) == SchedulerLimits(128, 128, 144.0, "derived")
    # A scale alone stretches the steps' time: 96 tokens beside 8 decodes (208 ms) is past reading
    # pace, so the step is the largest candidate within it.
    assert derive_scheduler_limits(sp, ServedCost(PROPORTIONAL, 2.0, SERVED_DERIVE_STEPS)) == \
        SchedulerLimits(64, 64, 144.0, "derived")
    # Explicit limits stay what they are.
    fixed = resolve_config(None, ["scheduler.tokenBudget=64", "scheduler.prefillChunkSize=32"]).scheduler
    assert derive_scheduler_limits(fixed, served) == SchedulerLimits(64, 32, None, "set")


def test_derived_limits_are_derived_again_once_the_line_is_fitted_and_every_derive_steps_after() -> None:
    """LimitsFollower derives null limits again when SERVED_MIN_STEPS steps are judged (the served
    line is first fitted) and every SERVED_DERIVE_STEPS judged steps after, never in between; steps
    that cost 8 ms more than the table, then 40 ms more, move the target at exactly those steps.
    Explicit limits never move."""
    from magnitude.engine.output import ScheduledSeq, StepPlan
    from magnitude.engine.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=1, temperature=0.0)

    def run(sp, steps: int) -> list[tuple[int, SchedulerLimits]]:
        follower, start, changes = LimitsFollower(sp, PROPORTIONAL), 0.0, []
        for i in range(steps):
            d = 1 + (5 * i) % 16
            plan = StepPlan(i, [ScheduledSeq(f"r{j}", [1], 200, [j], True, greedy) for j in range(d)])
            change = follower.after_step(plan, start, decoding=True)
            if change is not None:
                assert change.old == (changes[-1][1] if changes else derive_scheduler_limits(sp, PROPORTIONAL))
                changes.append((follower.served.steps, change.new))
            # The first judged steps pay 8 ms beyond the table, those from the 40th on 40 ms.
            start += PROPORTIONAL.step_seconds(plan) + (0.008 if i < 40 else 0.040)
        return changes

    changes = run(resolve_config(None, []).scheduler, 3 * SERVED_DERIVE_STEPS)
    print("\n" + "\n".join(f"{n} judged steps: {limits}" for n, limits in changes))
    # The window keeps changing (its line and its scatter), so each derivation moves the limits again.
    assert [n for n, _ in changes] == [SERVED_MIN_STEPS + k * SERVED_DERIVE_STEPS for k in range(3)]
    targets = [limits.itl_target_ms for _, limits in changes]
    # At the 16th, the 8 ms line's 144 ms (test_limits_follow_served_steps_once_enough_are_judged); at
    # the 80th, with the dearer steps in the window, more.
    assert targets[0] == pytest.approx(144.0, abs=2.0) and targets[1] > 1.1 * targets[0]
    explicit = resolve_config(None, ["scheduler.tokenBudget=64", "scheduler.prefillChunkSize=32"]).scheduler
    assert run(explicit, 3 * SERVED_DERIVE_STEPS) == []


def test_a_replay_of_served_times_follows_them_as_the_engine_did() -> None:
    """A `/debug/cost-model` document's served line is what the replay's steps take; the limits
    start where the engine's did (the table's, the target with a cold start's margin) and follow the steps the replay serves on the
    engine's schedule, not the line the engine ended with from the first step (a replay that did
    ran half the engine's steps at 1.5x its ITL on a recording, bench/results/sim_fidelity.md)."""
    doc = {"kind": "table", "decode_batch_sizes": list(_ROWS), "prefill_tokens": list(_COLS),
           "seconds": [list(r) for r in PROPORTIONAL.seconds],
           "meta": {"servedOverPredicted": 1.0, "servedFixedSeconds": 0.008, "servedSteps": 600}}
    result = simulate(documents(), resolve_config(None, []), cost_model_from_document(doc))
    # The table's, with the margin a cold start keeps (SERVED_COLD_MARGIN), as the engine started.
    assert result.config.scheduler.itl_target_ms == pytest.approx(104.0 * (1 + SERVED_COLD_MARGIN), abs=0.1)
    # The table's limits (96 / 96 / 156 ms) run while the replay learns the fixed 8 ms. Once
    # SERVED_MIN_STEPS steps are judged (the first decoding step is not: nothing ran before it) the
    # line is fitted and the limits are derived from it (128 / 128 / 144 ms from the line itself,
    # test above), once: the steps after it are the bigger ones that line finds efficient (over the
    # 104 ms that 96 tokens and the fixed cost take at most), and none over the new target.
    [(changed_at, limits)] = result.limits_changes
    assert build_report(result)["limits_changes"] == [{"t": changed_at, **limits.to_document()}]
    assert limits.itl_target_ms == pytest.approx(144.0, abs=2.0) and limits.prefill_chunk_size > 96
    before = [s for s in decoding_steps(result) if s.t < changed_at]
    after = [s for s in decoding_steps(result) if s.t >= changed_at]
    assert len(before) == SERVED_MIN_STEPS + 1
    assert len(after) > 30 and max(s.duration for s in after) > 0.104
    assert max(s.duration for s in after) <= limits.itl_target_ms / 1000.0 + 1e-9
    # A table without a served line: its steps take the table's times, and the limits stay.
    plain = simulate(documents(), resolve_config(None, []), PROPORTIONAL)
    assert plain.limits_changes == [] and plain.config.scheduler.itl_target_ms == 104.0


def test_derived_limits_move_only_past_the_tolerance() -> None:
    old = SchedulerLimits(64, 48, 70.0, "derived")
    assert not limits_moved(old, SchedulerLimits(70, 52, 76.9, "derived"))
    assert limits_moved(old, SchedulerLimits(64, 48, 77.1, "derived"))
    assert limits_moved(old, SchedulerLimits(71, 48, 70.0, "derived"))
    assert limits_moved(old, SchedulerLimits(64, 43, 70.0, "derived"))
    assert limits_moved(old, SchedulerLimits(64, 48, None, "set"))


def test_an_explicit_target_bounds_served_steps() -> None:
    served = ServedCost(MEASURED, 2.0)
    # The bound starts from the table as measured (a document's served line is another run's), and
    # learns this run's served steps.
    explicit = resolve_config(None, ["scheduler.itlTargetMs=150"]).scheduler
    follower = LimitsFollower(explicit, served)
    assert follower.bound.served is follower.served and follower.bound.seconds_for(4, 64) == MEASURED.seconds_for(4, 64)

    config = resolve_config(None, ["scheduler.tokenBudget=8192", "scheduler.itlTargetMs=150"])
    steps = decoding_steps(simulate(documents(), config, served))
    # The replay's steps last the served times (the table's x 2). Like the engine it bounds them on
    # the table until SERVED_EARLY_STEPS are judged, and on what it learned after: within the target.
    print("\nfirst decoding steps (ms):", [round(s.duration * 1000) for s in steps[:SERVED_MIN_STEPS]])
    assert max(s.duration for s in steps[:SERVED_EARLY_STEPS]) > 0.150
    late = steps[2 * SERVED_EARLY_STEPS:]
    assert len(late) > 30 and max(s.duration for s in late) <= 0.150 + 1e-9
    # On the table alone the same target admits steps over half of it, which served would miss.
    table_steps = decoding_steps(simulate(documents(), config, MEASURED))
    assert max(s.duration for s in table_steps) > 0.075


def test_a_document_with_the_served_factor_replays_served_times(tmp_path) -> None:
    # Explicit limits and no target: the plans do not depend on the step times.
    config = resolve_config(None, ["scheduler.tokenBudget=256", "scheduler.prefillChunkSize=128"])
    burst = [r.model_copy(update={"arrival": 0.0}) for r in documents()]  # the same plans at any speed
    plain = simulate(burst, config, cost_model_from_document(table_document(device="cpu")))
    served_model = cost_model_from_document(table_document(device="cpu", servedOverPredicted=1.5,
                                                           servedFixedSeconds=0.004, servedSteps=400))
    assert isinstance(served_model, ServedCost) and served_model.steps == 400
    assert served_model.document_meta() == {"servedOverPredicted": 1.5, "servedFixedSeconds": 0.004,
                                            "servedPerDecodeSeconds": 0.0, "servedNoiseMargin": 0.0,
                                            "servedMarginHistory": [], "servedLineHistory": [], "servedSteps": 400,
                                            "servedPrefillOnlyOverPredicted": None, "servedPrefillOnlySteps": 0}
    served = simulate(burst, config, served_model)
    # The same plans; every step lasts 4 ms + 1.5x.
    assert [(s.decode, s.prefill) for s in served.steps] == [(s.decode, s.prefill) for s in plain.steps]
    assert len(served.steps) > 20
    for a, b in zip(served.steps, plain.steps):
        assert a.duration == pytest.approx(0.004 + 1.5 * b.duration)
    assert "served" in served_model.name
    # With a share per decode, each step pays it for the decodes it carries.
    per_decode = cost_model_from_document(table_document(device="cpu", servedOverPredicted=1.5, servedFixedSeconds=0.004,
                                                         servedPerDecodeSeconds=0.0005, servedSteps=400))
    streamed = simulate(burst, config, per_decode)
    assert [(s.decode, s.prefill) for s in streamed.steps] == [(s.decode, s.prefill) for s in plain.steps]
    assert max(len(s.decode) for s in streamed.steps) > 4
    for a, b in zip(streamed.steps, plain.steps):
        assert a.duration == pytest.approx(0.004 + 0.0005 * len(a.decode) + 1.5 * b.duration)
    assert per_decode.document_meta()["servedPerDecodeSeconds"] == 0.0005
    # A document from before the fixed cost was fitted: the ratio alone.
    assert cost_model_from_document(table_document(servedOverPredicted=1.5)).fixed_s == 0.0
    assert cost_model_from_document(table_document(servedOverPredicted=1.5)).per_decode_s == 0.0


@pytest.mark.parametrize("bad", [0.1, 10.0, "2", True])
def test_a_served_factor_out_of_bounds_is_refused_by_name(bad) -> None:
    with pytest.raises(CostModelError, match="meta.servedOverPredicted"):
        cost_model_from_document(json.loads(json.dumps(table_document(servedOverPredicted=bad))))


def test_a_served_step_count_that_is_not_a_count_is_refused_by_name() -> None:
    with pytest.raises(CostModelError, match="meta.servedSteps"):
        cost_model_from_document(table_document(servedOverPredicted=1.2, servedSteps="many"))


@pytest.mark.parametrize("bad", [-0.001, 0.5, "0.01", True])
def test_a_served_fixed_cost_out_of_bounds_is_refused_by_name(bad) -> None:
    with pytest.raises(CostModelError, match="meta.servedFixedSeconds"):
        cost_model_from_document(json.loads(json.dumps(table_document(servedOverPredicted=1.2, servedFixedSeconds=bad))))


@pytest.mark.parametrize("bad", [-0.001, 0.05, "0.001", True])
def test_a_served_per_decode_cost_out_of_bounds_is_refused_by_name(bad) -> None:
    with pytest.raises(CostModelError, match="meta.servedPerDecodeSeconds"):
        cost_model_from_document(json.loads(json.dumps(table_document(servedOverPredicted=1.2,
                                                                      servedPerDecodeSeconds=bad))))


@pytest.mark.parametrize("bad", [-0.1, 0.6, "0.1", True])
def test_a_served_noise_margin_out_of_bounds_is_refused_by_name(bad) -> None:
    with pytest.raises(CostModelError, match="meta.servedNoiseMargin"):
        cost_model_from_document(json.loads(json.dumps(table_document(servedOverPredicted=1.2,
                                                                      servedNoiseMargin=bad))))


def _scattered(served: ServedCost, slow_every: int, slow: float, steps: int = SERVED_WINDOW, phase: int = 0) -> None:
    """Steps of 5-100 ms on the table's times (step i: 5 ms x (1 + i % 20)), every `slow_every`th
    (counting from `phase`) `slow` times as long."""
    for i in range(steps):
        p = 0.005 + 0.005 * (i % 20)
        served.observe(p, p * (slow if (i - phase) % slow_every == 0 else 1.0))


def test_the_margin_is_the_worst_big_step_about_the_line() -> None:
    """One step in five 1.5x its line, some of them big: the margin is what the big ones ran over
    the line. One in twenty slow, each a 100 ms step (the window's biggest): a 90th percentile of
    the seconds would pass over them, and a stream's longest gap is one of them, so the margin is
    theirs too. One in twenty slow, each a 5 ms step: small steps scatter and a target does not
    cut them, no margin. No scatter, no margin; a wild one is capped. Refitted every
    SERVED_MARGIN_EVERY steps."""
    every_fifth, big_twentieth, small_twentieth, even, wild = (ServedCost(PROPORTIONAL) for _ in range(5))
    _scattered(every_fifth, 5, 1.5)
    _scattered(big_twentieth, 20, 1.5, phase=19)
    _scattered(small_twentieth, 20, 1.5)
    _scattered(even, 1, 1.0)
    _scattered(wild, 2, 3.0)
    print(f"\nmargins: {every_fifth.margin:.3f} {big_twentieth.margin:.3f} {small_twentieth.margin:.3f} "
          f"{even.margin:.3f} {wild.margin:.3f}")
    # The line through the scattered window lies above the plain steps, so the slow ones are less
    # than 1.5x over it, and the plain ones under it.
    line = every_fifth.seconds_for(0, 64)
    assert 0.2 < every_fifth.margin < 0.5
    assert every_fifth.margin == pytest.approx(PROPORTIONAL.seconds_for(0, 64) * 1.5 / line - 1.0, rel=0.2)
    assert 0.2 < big_twentieth.margin < 0.5
    assert big_twentieth.margin == pytest.approx(0.100 * 1.5 / big_twentieth.seconds_for(0, 100) - 1.0, rel=0.05)
    assert small_twentieth.margin < 0.05
    assert even.margin == 0.0
    assert wild.margin == SERVED_MAX_MARGIN
    # It moves only every SERVED_MARGIN_EVERY judged steps.
    before = even.margin
    even.observe(0.05, 0.2)
    assert even.margin == before and even.steps % SERVED_MARGIN_EVERY != 0


def test_an_explicit_target_is_kept_at_the_margin() -> None:
    """The scheduler's bound is the served line times (1 + margin): a step sized to the target on
    the line alone would run past it one time in five here; on the bound it is smaller."""
    sp = resolve_config(None, ["scheduler.itlTargetMs=150"]).scheduler
    follower = LimitsFollower(sp, PROPORTIONAL)
    assert isinstance(follower.bound, ServedBound)
    _scattered(follower.served, 5, 1.5)
    margin = follower.served.margin
    assert follower.bound.margin == margin > 0.2
    assert follower.bound.seconds_for(8, 64) == pytest.approx(follower.served.seconds_for(8, 64) * (1 + margin))
    assert f"{margin:.0%} margin" in follower.bound.name
    limits = derive_scheduler_limits(sp, follower.bound)
    on_line = derive_scheduler_limits(sp, follower.served)
    assert limits.itl_target_ms == on_line.itl_target_ms == 150.0
    assert limits.token_budget < on_line.token_budget
    assert follower.bound.seconds_for(0, limits.token_budget) <= 0.150


def test_a_derived_target_carries_the_margin_on_the_same_steps() -> None:
    """With no target the steps are the line's efficient ones (a margin scales every step alike,
    and reading pace is judged on what steps take); the target promised is their time with the
    margin, so the scheduler's bound still admits them."""
    sp = resolve_config(None, []).scheduler
    served = ServedCost(PROPORTIONAL, 1.0, SERVED_DERIVE_STEPS, 0.008, margin=0.3)
    bound = ServedBound(served)
    assert derivation_model(bound) is bound
    on_line, with_margin = derive_scheduler_limits(sp, served), derive_scheduler_limits(sp, bound)
    assert on_line == SchedulerLimits(128, 128, 144.0, "derived")
    assert (with_margin.token_budget, with_margin.prefill_chunk_size) == (128, 128)
    assert with_margin.itl_target_ms == pytest.approx(144.0 * 1.3, abs=0.1)
    assert bound.seconds_for(8, 128) * 1000.0 <= with_margin.itl_target_ms + 1e-9
    # Before SERVED_MIN_STEPS judged steps the table, with no margin.
    young = ServedBound(ServedCost(PROPORTIONAL, 1.0, SERVED_MIN_STEPS - 1, 0.008, margin=0.3))
    assert derivation_model(young) is PROPORTIONAL


def test_a_cold_start_keeps_the_largest_margin_until_the_line_is_fitted() -> None:
    """With `cold_margin` (the engine's SERVED_COLD_MARGIN) the bound is the table (then the early
    ratio) times 1 + that margin until SERVED_MIN_STEPS steps are judged, and the target derived at
    start carries it on the same steps (budget and chunk derived on the table); an explicit target
    keeps its limits, and its first steps are held smaller by the bound. Once fitted, the window's
    own margin. Without it (a plain table's simulation), the table as measured."""
    from magnitude.engine.output import ScheduledSeq, StepPlan
    from magnitude.engine.sampling import SamplingParams

    derived_sp, explicit_sp = resolve_config(None, []).scheduler, resolve_config(None, ["scheduler.itlTargetMs=150"]).scheduler
    warm, cold = LimitsFollower(derived_sp, PROPORTIONAL), LimitsFollower(derived_sp, PROPORTIONAL, cold_margin=SERVED_COLD_MARGIN)
    assert warm.limits == derive_scheduler_limits(derived_sp, PROPORTIONAL)
    assert (cold.limits.token_budget, cold.limits.prefill_chunk_size) == (warm.limits.token_budget, warm.limits.prefill_chunk_size)
    assert cold.limits.itl_target_ms == pytest.approx(warm.limits.itl_target_ms * (1 + SERVED_COLD_MARGIN), abs=0.1)
    assert cold.bound.seconds_for(8, 64) == pytest.approx(PROPORTIONAL.seconds_for(8, 64) * (1 + SERVED_COLD_MARGIN))
    assert warm.bound.seconds_for(8, 64) == pytest.approx(PROPORTIONAL.seconds_for(8, 64))
    # An explicit target keeps its number and caps; the cold bound holds the first steps under it.
    explicit_cold = LimitsFollower(explicit_sp, PROPORTIONAL, cold_margin=SERVED_COLD_MARGIN)
    explicit_warm = LimitsFollower(explicit_sp, PROPORTIONAL)
    assert explicit_cold.limits == explicit_warm.limits and explicit_cold.limits.itl_target_ms == 150.0
    budget = explicit_cold.limits.token_budget
    assert explicit_warm.bound.seconds_for(0, budget) <= 0.150 < explicit_cold.bound.seconds_for(0, budget)
    # Steps that take the table exactly: once the line is fitted, no scatter and no margin.
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    start = 0.0
    for i in range(SERVED_MIN_STEPS + 1):
        plan = StepPlan(i, [ScheduledSeq(f"r{j}", [1], 200, [j], True, greedy) for j in range(1 + i % 8)])
        cold.after_step(plan, start, decoding=True)
        if cold.served.steps < SERVED_MIN_STEPS:
            assert cold.bound.margin == SERVED_COLD_MARGIN
        start += PROPORTIONAL.step_seconds(plan)
    assert cold.served.steps >= SERVED_MIN_STEPS and cold.bound.margin == pytest.approx(0.0, abs=0.01)


def test_a_replay_keeps_the_documents_margin() -> None:
    """A replay's steps take the document's line exactly, so it learns no scatter of its own: its
    bound keeps the document's margin once its line is fitted, and its steps are that much smaller
    than the same replay's with none; the engine's document carries the margin it learned."""
    config = resolve_config(None, ["scheduler.tokenBudget=8192", "scheduler.itlTargetMs=150"])
    meta = {"servedOverPredicted": 1.0, "servedFixedSeconds": 0.004, "servedSteps": 600}
    calm = cost_model_from_document(table_document(**meta))
    noisy = cost_model_from_document(table_document(**meta, servedNoiseMargin=0.4))
    assert noisy.margin == 0.4 and noisy.document_meta()["servedNoiseMargin"] == 0.4
    calm_steps = decoding_steps(simulate(documents(), config, calm))[2 * SERVED_MIN_STEPS:]
    noisy_steps = decoding_steps(simulate(documents(), config, noisy))[2 * SERVED_MIN_STEPS:]
    longest_calm, longest_noisy = max(s.duration for s in calm_steps), max(s.duration for s in noisy_steps)
    print(f"\nlongest decoding step: {longest_calm * 1000:.1f} ms, with the margin {longest_noisy * 1000:.1f} ms")
    assert longest_calm <= 0.150 + 1e-9 and longest_noisy <= 0.150 / 1.4 + 1e-9 < longest_calm


def test_the_margin_history_dates_each_move() -> None:
    """Each refit that moves the margin by SERVED_MARGIN_HISTORY_STEP or more is kept with the time
    the step was judged at; a margin that moves less adds nothing; the document counts seconds from the engine's start (`origin`)."""
    noisy, even = ServedCost(PROPORTIONAL), ServedCost(PROPORTIONAL)
    for i in range(3 * SERVED_WINDOW):
        p = 0.005 + 0.005 * (i % 20)
        slow = 1.5 if i >= SERVED_WINDOW and i % 5 == 0 else 1.0  # calm, then one step in five slow
        noisy.observe(p, p * slow, at=100.0 + 0.1 * i)
        even.observe(p, p, at=100.0 + 0.1 * i)
    history = list(noisy.margin_history)
    print(f"\nmargin history: {[(round(t, 1), round(m, 3)) for t, m in history]}")
    assert history[0] == (100.0 + 0.1 * (SERVED_MIN_STEPS - 1), 0.0)
    assert history[-1][1] == pytest.approx(noisy.margin, abs=SERVED_MARGIN_HISTORY_STEP) and noisy.margin > 0.2
    assert [t for t, _ in history] == sorted(t for t, _ in history)
    assert all(abs(a[1] - b[1]) >= SERVED_MARGIN_HISTORY_STEP for a, b in zip(history, history[1:]))
    assert len(history) < (2 * SERVED_WINDOW) // SERVED_MARGIN_EVERY  # not every refit
    assert 100.0 + 0.1 * SERVED_WINDOW <= history[1][0]  # the margin moved only once the slow steps came
    assert list(even.margin_history) == [(100.0 + 0.1 * (SERVED_MIN_STEPS - 1), 0.0)]
    meta = noisy.document_meta(origin=100.0)
    assert meta["servedMarginHistory"] == [[round(t - 100.0, 3), round(m, 4)] for t, m in history]
    # Steps judged without a time (a learner outside the engine) date nothing.
    undated = ServedCost(PROPORTIONAL)
    _scattered(undated, 5, 1.5)
    assert undated.margin > 0.2 and not undated.margin_history
    # At most SERVED_MARGIN_HISTORY moves are kept, the last ones.
    kept = ServedCost(PROPORTIONAL, margin_history=tuple((float(i), 0.0) for i in range(SERVED_MARGIN_HISTORY)))
    kept.margin_history.append((1e6, 0.1))
    assert len(kept.margin_history) == SERVED_MARGIN_HISTORY and kept.margin_history[0][0] == 1.0


def test_the_margin_in_force_is_the_latest_dated_before() -> None:
    history = ((10.0, 0.0), (20.0, 0.2), (30.0, 0.4))
    assert [margin_at(history, t) for t in (0.0, 10.0, 19.9, 20.0, 29.0, 31.0, 1e9)] == [0.0, 0.0, 0.0, 0.2, 0.2, 0.4, 0.4]
    assert margin_at(((5.0, 0.3),), 1.0) == 0.3  # a history cut to its last entries starts at its first
    assert margin_at((), 1.0) == 0.0


def test_a_document_carries_the_margin_history() -> None:
    doc = table_document(servedOverPredicted=1.2, servedNoiseMargin=0.3, servedSteps=900,
                         servedMarginHistory=[[1.5, 0.0], [7.25, 0.1], [7.25, 0.3]])
    served = cost_model_from_document(json.loads(json.dumps(doc)))
    assert list(served.margin_history) == [(1.5, 0.0), (7.25, 0.1), (7.25, 0.3)]
    assert served.document_meta()["servedMarginHistory"] == [[1.5, 0.0], [7.25, 0.1], [7.25, 0.3]]
    assert not cost_model_from_document(table_document(servedOverPredicted=1.2)).margin_history  # older documents


@pytest.mark.parametrize("bad", [{"t": 1}, [[1.0]], [[1.0, 0.1, 2]], [[-1.0, 0.1]], [[1.0, 0.6]], [[1.0, -0.1]],
                                 [[2.0, 0.1], [1.0, 0.1]], [["1", 0.1]], [[True, 0.1]], [[float("nan"), 0.1]],
                                 [[float(i), 0.1] for i in range(SERVED_MARGIN_HISTORY + 1)]])
def test_a_malformed_margin_history_is_refused_by_name(bad) -> None:
    with pytest.raises(CostModelError, match="meta.servedMarginHistory"):
        cost_model_from_document(table_document(servedOverPredicted=1.2, servedMarginHistory=bad))


def test_a_replay_follows_the_margin_as_it_moved() -> None:
    """A document that dates its margin (0 until `moved`, then 0.4) replays on the same clock: the
    steps before `moved` are the calm replay's, the ones after it the margin's smaller ones."""
    config = resolve_config(None, ["scheduler.tokenBudget=8192", "scheduler.itlTargetMs=150"])
    meta = {"servedOverPredicted": 1.0, "servedFixedSeconds": 0.004, "servedSteps": 600}
    calm_steps = decoding_steps(simulate(documents(), config, cost_model_from_document(table_document(**meta))))
    moved = calm_steps[len(calm_steps) // 2].t
    dated = cost_model_from_document(table_document(**meta, servedNoiseMargin=0.4,
                                                    servedMarginHistory=[[0.5, 0.0], [moved, 0.4]]))
    steps = decoding_steps(simulate(documents(), config, dated))
    before = [s for s in steps if s.t < moved][2 * SERVED_MIN_STEPS:]
    after = [s for s in steps if s.t >= moved + 0.2]  # the step judged at `moved` runs on with the old bound
    longest_before, longest_after = max(s.duration for s in before), max(s.duration for s in after)
    print(f"\nlongest decoding step before the move {longest_before * 1000:.1f} ms, after {longest_after * 1000:.1f} ms")
    assert 0.150 / 1.4 + 0.005 < longest_before <= 0.150 + 1e-9
    assert longest_after <= 0.150 / 1.4 + 1e-9


def test_the_line_history_dates_each_move() -> None:
    """From the SERVED_EARLY_STEPS-th judged step, each step that moves the line's time for the
    window's mean step by SERVED_LINE_HISTORY_STEP or more is kept with the time it was judged at;
    steady steps add nothing; the document counts seconds from the engine's start."""
    served = ServedCost(PROPORTIONAL)
    for i in range(3 * SERVED_WINDOW):
        p = 0.005 + 0.005 * (i % 20)
        slow = 1.6 if i < 40 else 1.0  # a slow first few seconds, then the table's own times
        served.observe(p, p * slow, at=100.0 + 0.1 * i)
    history = list(served.line_history)
    print(f"\nline history: {[(round(t, 1), round(f * 1000, 2), round(d * 1000, 2), round(s, 3)) for t, f, d, s in history]}")
    assert history[0] == (100.0 + 0.1 * (SERVED_EARLY_STEPS - 1), 0.0, 0.0, pytest.approx(1.6))
    assert [t for t, *_ in history] == sorted(t for t, *_ in history)
    assert 2 < len(history) < SERVED_WINDOW  # not every step
    assert served.line_at(0.0) == served.line_at(history[0][0]) == history[0][1:]
    assert served.line_at(1e9) == history[-1][1:]
    fixed, per_decode, factor = served.line_at(1e9)
    assert fixed + factor * 0.05 == pytest.approx(served.fixed_s + served.factor * 0.05, rel=SERVED_LINE_HISTORY_STEP)
    assert fixed + factor * 0.05 == pytest.approx(0.05, rel=0.02)  # the slow start is out of the window
    meta = served.document_meta(origin=100.0)
    assert meta["servedLineHistory"] == [[round(t - 100.0, 3), round(f, 5), round(d, 6), round(k, 4)]
                                         for t, f, d, k in history]
    # Steps judged without a time date nothing, and a model without a history prices on its own line.
    undated = ServedCost(PROPORTIONAL, 1.5, SERVED_DERIVE_STEPS, 0.004)
    _scattered(undated, 5, 1.5)
    assert not undated.line_history and undated.line_at(3.0) == (undated.fixed_s, undated.per_decode_s, undated.factor)


def test_a_document_carries_the_line_history() -> None:
    doc = table_document(servedOverPredicted=1.0, servedFixedSeconds=0.004, servedSteps=900,
                         servedLineHistory=[[0.4, 0.0, 0.0, 1.6], [3.2, 0.019, 0.0018, 1.05], [9.0, 0.004, 0.0, 1.0]])
    served = cost_model_from_document(json.loads(json.dumps(doc)))
    assert list(served.line_history) == [(0.4, 0.0, 0.0, 1.6), (3.2, 0.019, 0.0018, 1.05), (9.0, 0.004, 0.0, 1.0)]
    assert served.document_meta()["servedLineHistory"] == doc["meta"]["servedLineHistory"]
    assert served.line_at(5.0) == (0.019, 0.0018, 1.05)
    assert not cost_model_from_document(table_document(servedOverPredicted=1.2)).line_history  # older documents


@pytest.mark.parametrize("bad", [{"t": 1}, [[1.0, 0.0, 0.0]], [[-1.0, 0.0, 0.0, 1.0]], [[1.0, 0.06, 0.0, 1.0]],
                                 [[1.0, 0.0, 0.006, 1.0]], [[1.0, 0.0, 0.0, 0.4]], [[1.0, 0.0, 0.0, 4.5]],
                                 [[2.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 1.0]], [["1", 0.0, 0.0, 1.0]],
                                 [[1.0, True, 0.0, 1.0]], [[1.0, float("inf"), 0.0, 1.0]],
                                 [[float(i), 0.0, 0.0, 1.0] for i in range(SERVED_LINE_HISTORY + 1)]])
def test_a_malformed_line_history_is_refused_by_name(bad) -> None:
    with pytest.raises(CostModelError, match="meta.servedLineHistory"):
        cost_model_from_document(table_document(servedOverPredicted=1.2, servedLineHistory=bad))


def test_a_replay_prices_each_step_on_the_line_in_force() -> None:
    """A document that dates its line (1.8x the table until `moved`, then 4 ms + 1.0x) replays on the
    same clock: the steps that start before `moved` take the first line's time, the ones after it
    the second's; the same document without the history prices every step on its own line."""
    config = resolve_config(None, ["scheduler.tokenBudget=256", "scheduler.prefillChunkSize=128"])
    meta = {"servedOverPredicted": 1.0, "servedFixedSeconds": 0.004, "servedSteps": 600}
    table = cost_model_from_document(table_document())
    own = simulate(documents(), config, cost_model_from_document(table_document(**meta)))
    moved = own.steps[len(own.steps) // 3].t
    dated = simulate(documents(), config, cost_model_from_document(table_document(
        **meta, servedLineHistory=[[0.5, 0.0, 0.0, 1.8], [moved, 0.004, 0.0, 1.0]])))
    for step in dated.steps:
        plan_s = table.seconds_for(len(step.decode), sum(n for _, n in step.prefill))
        want = 1.8 * plan_s if step.t < moved else 0.004 + plan_s
        assert step.duration == pytest.approx(want, rel=1e-6), step
    assert any(s.t < moved for s in dated.steps) and any(s.t >= moved for s in dated.steps)
    for step in own.steps:
        assert step.duration == pytest.approx(0.004 + table.seconds_for(len(step.decode), sum(n for _, n in step.prefill)))


def test_prefill_only_steps_keep_their_own_ratio_to_the_table() -> None:
    """No stream waits on a prefill-only step, so the line is not fitted to it; the learner keeps
    what such steps took over what the table predicted (summed, the last SERVED_WINDOW of them),
    from SERVED_EARLY_STEPS on, within the line's bounds, and leaves the line alone."""
    served = ServedCost(MEASURED)
    for _ in range(SERVED_EARLY_STEPS - 1):
        served.observe_prefill_only(0.200, 0.210)
    assert served.prefill_only_factor is None and served.prefill_only_steps == SERVED_EARLY_STEPS - 1
    served.observe_prefill_only(0.400, 0.500)
    assert served.prefill_only_factor == pytest.approx((3 * 0.210 + 0.500) / (3 * 0.200 + 0.400))
    # Only the last SERVED_WINDOW count: a window of 1.3x steps replaces the first ones.
    for _ in range(SERVED_WINDOW):
        served.observe_prefill_only(0.100, 0.130)
    assert served.prefill_only_factor == pytest.approx(1.3)
    assert served.prefill_only_steps == SERVED_WINDOW + SERVED_EARLY_STEPS
    # A step predicted at nearly nothing is not judged; a stall counts as the line's bounds allow.
    served.observe_prefill_only(1e-5, 1.0)
    assert served.prefill_only_steps == SERVED_WINDOW + SERVED_EARLY_STEPS
    stalled = ServedCost(MEASURED)
    for _ in range(SERVED_EARLY_STEPS - 1):
        stalled.observe_prefill_only(0.100, 0.100)
    stalled.observe_prefill_only(0.100, 60.0)
    capped = SERVED_MAX_FIXED_S + SERVED_FACTOR_BOUNDS[1] * 0.100
    assert stalled.prefill_only_factor == pytest.approx((0.300 + capped) / 0.400)  # 1.875, not 4x
    # The line and its counts are the decoding steps' alone.
    assert (served.steps, served.factor, served.fixed_s, served.per_decode_s) == (0, 1.0, 0.0, 0.0)


def test_the_follower_judges_a_prefill_only_step_until_the_next_step_starts() -> None:
    """A prefill-only step is judged from its start to the next step's (any step: its prompt goes on
    or starts decoding), as a decoding step is; an idle call between breaks the chain. The decoding
    steps around them still teach only the line."""
    from magnitude.engine.output import ScheduledSeq, StepPlan
    from magnitude.engine.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    follower = LimitsFollower(resolve_config(None, ["scheduler.itlTargetMs=150"]).scheduler, MEASURED)
    chunk = StepPlan(0, [ScheduledSeq("p", [1] * 64, 0, [99], False, greedy)])
    decodes = StepPlan(1, [ScheduledSeq(f"r{j}", [1], 200, [j], True, greedy) for j in range(4)])
    t = 0.0
    for i in range(2 * SERVED_WINDOW):
        # Prefill-only steps take 1.25x the table, decoding steps 0.9x: the line learns 0.9 alone.
        plan = chunk if i % 3 == 0 else decodes
        follower.after_step(plan, t, decoding=plan is decodes)
        t += (1.25 if plan is chunk else 0.9) * MEASURED.step_seconds(plan)
    served = follower.served
    assert served.prefill_only_factor == pytest.approx(1.25)
    assert served.factor == pytest.approx(0.9, rel=0.02) and served.fixed_s == pytest.approx(0.0, abs=1e-4)
    judged = served.prefill_only_steps
    # A prefill-only step, then the loop idles (nothing ran): not judged, however long it was.
    follower.after_step(chunk, t, decoding=False)
    follower.after_step(None, t + 5.0, decoding=False)
    follower.after_step(decodes, t + 6.0, decoding=True)
    assert served.prefill_only_steps == judged and served.prefill_only_factor == pytest.approx(1.25)
    follower.after_step(chunk, t + 7.0, decoding=False)
    follower.after_step(StepPlan(2, []), t + 9.0, decoding=False)  # an empty plan: nothing ran
    assert served.prefill_only_steps == judged
    # A step whose requests failed (the runner raised: the engine's RunnerOutput.failed) is not judged,
    # nor is the step before it judged against its start.
    follower.after_step(chunk, t + 10.0, decoding=False)
    follower.after_step(chunk, t + 10.001, decoding=False, failed=True)
    follower.after_step(chunk, t + 12.0, decoding=False)
    assert served.prefill_only_steps == judged
    follower.after_step(decodes, t + 12.0 + 1.25 * MEASURED.step_seconds(chunk), decoding=True)
    assert served.prefill_only_steps == judged + 1 and served.prefill_only_factor == pytest.approx(1.25)


def test_the_follower_judges_each_decoding_gap_against_the_target_its_step_was_planned_under() -> None:
    """`last_itl_gap` is what running streams waited, one decoding step's start to the next's, with
    the target the first of the two was planned under (the engine counts it into
    magnitude_scheduler_itl_gaps_total): none around a prefill-only step, after an idle call or with
    no target; when a derivation moves the target, the step planned before it keeps the old one."""
    from magnitude.engine.output import ScheduledSeq, StepPlan
    from magnitude.engine.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    decodes = StepPlan(1, [ScheduledSeq(f"r{j}", [1], 200, [j], True, greedy) for j in range(4)])
    chunk = StepPlan(0, [ScheduledSeq("p", [1] * 64, 0, [99], False, greedy)])
    follower = LimitsFollower(resolve_config(None, ["scheduler.itlTargetMs=150"]).scheduler, MEASURED)
    follower.after_step(decodes, 0.0, decoding=True)
    assert follower.last_itl_gap is None  # nothing before it
    follower.after_step(decodes, 0.120, decoding=True)
    assert follower.last_itl_gap == pytest.approx((0.120, 0.150))
    follower.after_step(decodes, 0.300, decoding=True)
    assert follower.last_itl_gap == pytest.approx((0.180, 0.150))  # over the promise
    follower.after_step(chunk, 0.400, decoding=False)
    assert follower.last_itl_gap is None  # no decodes in it: the streams before it had finished
    follower.after_step(decodes, 0.500, decoding=True)
    assert follower.last_itl_gap is None  # nor was a stream waiting on a decode during the prefill-only step
    follower.after_step(None, 0.600, decoding=False)
    follower.after_step(decodes, 0.700, decoding=True)
    assert follower.last_itl_gap is None  # an idle call breaks the chain
    untargeted = LimitsFollower(resolve_config(None, ["scheduler.tokenBudget=64", "scheduler.prefillChunkSize=32"]).scheduler,
                                MEASURED)
    untargeted.after_step(decodes, 0.0, decoding=True)
    untargeted.after_step(decodes, 0.1, decoding=True)
    assert untargeted.limits.itl_target_ms is None and untargeted.last_itl_gap is None
    # Derived limits that move: the gap after the step that moved them is judged on the old target.
    derived = LimitsFollower(resolve_config(None, []).scheduler, PROPORTIONAL)
    start, judged, change_seen = 0.0, [], False
    for i in range(SERVED_MIN_STEPS + 2):
        before = derived.limits.itl_target_ms
        change = derived.after_step(decodes, start, decoding=True)
        if derived.last_itl_gap is not None:
            judged.append(derived.last_itl_gap)
        if change is not None:
            change_seen = True
            assert change.old.itl_target_ms == before != change.new.itl_target_ms
            derived.after_step(decodes, start + 0.05, decoding=True)
            assert derived.last_itl_gap == pytest.approx((0.05, before / 1000.0))
            break
        start += PROPORTIONAL.step_seconds(decodes) + 0.040
    assert change_seen and len(judged) >= SERVED_MIN_STEPS - 1


def test_a_replay_prices_prefill_only_steps_by_their_own_ratio() -> None:
    """A document with `meta.servedPrefillOnlyOverPredicted` replays its prefill-only steps at that
    ratio of the table and every step with decodes on the line; without it (or with it null, as an
    engine that judged too few reports it) prefill-only steps are on the line too. It round-trips."""
    config = resolve_config(None, ["scheduler.tokenBudget=256", "scheduler.prefillChunkSize=128"])
    meta = {"servedOverPredicted": 0.8, "servedFixedSeconds": 0.004, "servedPerDecodeSeconds": 0.001,
            "servedSteps": 600}
    table = cost_model_from_document(table_document())
    model = cost_model_from_document(table_document(**meta, servedPrefillOnlyOverPredicted=1.1,
                                                    servedPrefillOnlySteps=40))
    assert isinstance(model, ServedCost) and (model.prefill_only_factor, model.prefill_only_steps) == (1.1, 40)
    again = cost_model_from_document(table_document(**model.document_meta()))
    assert (again.prefill_only_factor, again.prefill_only_steps) == (1.1, 40)
    # Four documents at once: their first chunks run alone, then beside the first ones' decodes.
    trace = [r.model_copy(update={"arrival": 0.0}) for r in documents() if r.id.startswith("doc")]
    ratio = simulate(trace, config, model)
    line = simulate(trace, config, cost_model_from_document(table_document(**meta)))
    nulled = simulate(trace, config, cost_model_from_document(
        table_document(**meta, servedPrefillOnlyOverPredicted=None, servedPrefillOnlySteps=2)))
    prefill_only = [s for s in ratio.steps if not s.decode]
    assert len(prefill_only) >= 4 and len(prefill_only) < len(ratio.steps)
    for step in ratio.steps:
        plan_s = table.seconds_for(len(step.decode), sum(n for _, n in step.prefill))
        want = 1.1 * plan_s if not step.decode else 0.004 + 0.001 * len(step.decode) + 0.8 * plan_s
        assert step.duration == pytest.approx(want, rel=1e-6), step
    for result in (line, nulled):
        for step in result.steps:
            plan_s = table.seconds_for(len(step.decode), sum(n for _, n in step.prefill))
            assert step.duration == pytest.approx(0.004 + 0.001 * len(step.decode) + 0.8 * plan_s, rel=1e-6), step


@pytest.mark.parametrize("key, bad", [("servedPrefillOnlyOverPredicted", 0.1), ("servedPrefillOnlyOverPredicted", "1.1"),
                                      ("servedPrefillOnlyOverPredicted", True), ("servedPrefillOnlySteps", -1),
                                      ("servedPrefillOnlySteps", 2.0)])
def test_a_malformed_prefill_only_ratio_is_refused_by_name(key: str, bad) -> None:
    with pytest.raises(CostModelError, match=f"meta.{key}"):
        cost_model_from_document(table_document(servedOverPredicted=1.2, **{key: bad}))


def test_a_swap_only_step_stays_on_the_line_and_a_draft_model_replay_uses_the_ratio() -> None:
    """A step that only moves blocks (no sequences: the engine never judges it) is priced on the line
    even where the document has a prefill-only ratio; a replay with a draftModel prices steps
    without decodes by the ratio as a plain replay does."""
    from magnitude.engine.output import StepPlan
    from magnitude.sim.speculation import SpecModel

    meta = {"servedOverPredicted": 0.8, "servedFixedSeconds": 0.004, "servedSteps": 600,
            "servedPrefillOnlyOverPredicted": 1.3, "servedPrefillOnlySteps": 40}
    model = cost_model_from_document(table_document(**meta))
    swap = StepPlan(0, [], swap_in=[(1, 2), (3, 4)])
    assert model.replayed_seconds(swap) == model.step_seconds(swap)
    config = resolve_config(None, ["draftModel.method=ngram", "draftModel.numSpeculativeTokens=4",
                                   "draftModel.mode=on", "scheduler.tokenBudget=256",
                                   "scheduler.prefillChunkSize=128"])
    trace = [r.model_copy(update={"arrival": 0.0}) for r in documents() if r.id.startswith("doc")]
    result = simulate(trace, config, model, speculation=SpecModel(0.5, seed=1))
    table = cost_model_from_document(table_document())
    prefill_only = [s for s in result.steps if not s.decode]
    assert len(prefill_only) >= 4
    for step in prefill_only:
        assert step.duration == pytest.approx(1.3 * table.seconds_for(0, sum(n for _, n in step.prefill)), rel=1e-6)
