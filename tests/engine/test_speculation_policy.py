"""The `auto` speculation policy (engine/speculation.py): on while it pays, off when it loses,
re-measured by probes; modes on and off never move."""

from __future__ import annotations

import pytest

from magnitude.engine.speculation import SpeculationPolicy


def _run(policy: SpeculationPolicy, steps: int, on_s: float, off_s: float, tokens_on: float) -> list[bool]:
    """Decode steps of 4 sequences: step time and tokens per sequence depend on the state."""
    states = []
    for _ in range(steps):
        if policy.enabled:
            states.append(policy.observe(on_s, 4, round(4 * tokens_on), prefill=False, drafted=True))
        else:
            states.append(policy.observe(off_s, 4, 4, prefill=False, drafted=False))
    return states


def test_high_acceptance_keeps_speculation_on_after_measuring_off_once() -> None:
    p = SpeculationPolicy("auto", min_samples=4, probe_every=50)
    states = _run(p, 40, on_s=0.012, off_s=0.010, tokens_on=2.5)
    assert p.enabled and p.gain() is not None and p.gain() > 2
    assert states.count(False) == 4  # exactly the off measurement


def test_low_acceptance_turns_it_off_and_probes_bring_it_back_only_when_it_pays() -> None:
    p = SpeculationPolicy("auto", min_samples=4, probe_every=30)
    _run(p, 20, on_s=0.012, off_s=0.010, tokens_on=1.0)
    assert not p.enabled and p.gain() < 1
    states = _run(p, 60, on_s=0.012, off_s=0.010, tokens_on=1.0)
    assert states.count(True) > 0  # it probed
    assert not p.enabled
    # The workload turns copy-heavy: the next probe finds the gain and stays on.
    _run(p, 80, on_s=0.012, off_s=0.010, tokens_on=3.0)
    assert p.enabled


def test_fixed_modes_and_prefill_steps_do_not_move_it() -> None:
    for mode, expected in (("on", True), ("off", False)):
        p = SpeculationPolicy(mode, min_samples=1)
        assert _run(p, 20, on_s=1.0, off_s=0.001, tokens_on=1.0 if expected else 5.0) == [expected] * 20
    p = SpeculationPolicy("auto", min_samples=2)
    assert all(p.observe(5.0, 4, 4, prefill=True, drafted=True) for _ in range(20)) and p.gain() is None


def test_steps_without_drafts_measure_off_while_it_stays_on() -> None:
    """Prompt lookup proposing nothing costs a plain step: no need to switch off to measure it."""
    p = SpeculationPolicy("auto", min_samples=4)
    for _ in range(10):
        assert p.observe(0.010, 1, 1, prefill=False, drafted=False)  # plain steps, no switch
        assert p.observe(0.020, 1, 4, prefill=False, drafted=True)  # 4 tokens for twice the time
    assert p.enabled and p.gain() == pytest.approx(2.0)
    for _ in range(10):
        p.observe(0.020, 1, 1, prefill=False, drafted=True)  # drafts now all rejected
    assert not p.enabled


def test_time_saved_is_estimated_against_the_measured_plain_step_in_every_mode() -> None:
    """The engine's time-saved metric: tokens per sequence x plain step time - the drafted step's time."""
    for mode in ("on", "off", "auto"):
        p = SpeculationPolicy(mode, min_samples=100)  # no switching: only the estimate is under test
        assert p.saved_seconds(0.020, 2, 8) is None  # no plain step measured yet
        p.observe(0.010, 2, 2, prefill=False, drafted=False)
        p.observe(0.500, 2, 2, prefill=True, drafted=False)  # a prefill step measures nothing
        assert p.saved_seconds(0.020, 2, 8) == pytest.approx(4 * 0.010 - 0.020)  # 4 tokens each for 2 steps' time
        assert p.saved_seconds(0.030, 2, 2) == pytest.approx(0.010 - 0.030)  # all rejected: time lost
        assert p.saved_seconds(0.030, 0, 0) is None


def test_a_probe_that_still_loses_doubles_the_wait_and_a_gain_resets_it() -> None:
    p = SpeculationPolicy("auto", min_samples=4, probe_every=20)
    _run(p, 20, on_s=0.012, off_s=0.010, tokens_on=1.0)  # loses: off
    assert not p.enabled
    states = _run(p, 400, on_s=0.012, off_s=0.010, tokens_on=1.0)
    starts = [i for i in range(1, len(states)) if states[i] and not states[i - 1]]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(gaps) >= 2 and all(b > a for a, b in zip(gaps, gaps[1:])), gaps  # ever rarer probes
    _run(p, 1500, on_s=0.012, off_s=0.010, tokens_on=3.0)  # the workload turns: a probe finds the gain
    assert p.enabled and p._probe_wait == 20


def test_a_draft_step_dearer_than_lookahead_plus_one_plain_steps_ends_the_probe_at_once() -> None:
    # A slow draft model: whatever its acceptance, 4 + 1 tokens cannot pay for a step 8x a plain one.
    p = SpeculationPolicy("auto", min_samples=6, probe_every=20, lookahead=4)
    _run(p, 30, on_s=0.080, off_s=0.010, tokens_on=4.8)
    assert not p.enabled
    states = _run(p, 200, on_s=0.080, off_s=0.010, tokens_on=4.8)
    probes = [i for i in range(1, len(states)) if states[i] and not states[i - 1]]
    assert probes and all(states[i:i + 3].count(True) <= 2 for i in probes), states  # two drafted steps a probe
    unbounded = SpeculationPolicy("auto", min_samples=6, probe_every=20)  # lookahead unknown: the gain decides
    later = _run(unbounded, 230, on_s=0.080, off_s=0.010, tokens_on=4.8)[30:]
    assert states.count(True) < later.count(True), (states.count(True), later.count(True))
