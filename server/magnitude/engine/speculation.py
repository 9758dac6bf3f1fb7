"""The `auto` speculation policy: keep drafting only while it pays (pure; no I/O, no framework).

It watches decode steps (steps that carry no prefill chunk, so their cost is comparable) and
keeps two measurements: the time of a step whose decodes carried drafts, with the tokens each
sequence gained in it (1 + accepted drafts), and the time of a step without drafts — speculation
off, or prompt lookup found nothing to propose: such a step costs what an "off" step costs, so
it is measured while speculation is on too. Speculation pays when

    tokens_per_drafted_step / drafted_step_s  >  1 / plain_step_s   (decode tokens per second per sequence)

Starting on, it switches off when the measured gain falls below 1; while off it probes "on" again
every `probe_every` steps (acceptance changes with the workload: only drafting measures it) and
stays on if the gain exceeds 1 + `margin`. A probe costs drafted steps, so a probe that finds it
still losing doubles the wait before the next (up to `probe_every` × MAX_PROBE_BACKOFF; a gain
resets it), and with `lookahead` known a drafted step slower than (1 + lookahead) plain steps ends
a probe at once: no acceptance could make it pay (a slow draft model). Modes `on` and `off` never change the state, but the
costs are measured in every mode: `saved_seconds` estimates what each drafted step saved against
the measured plain step (the engine's time-saved metric).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["on", "off", "auto"]
MAX_PROBE_BACKOFF = 64


@dataclass(slots=True)
class _Ema:
    value: float | None = None
    samples: int = 0

    def add(self, x: float, alpha: float) -> None:
        self.value = x if self.value is None else (1 - alpha) * self.value + alpha * x
        self.samples += 1


@dataclass(slots=True)
class SpeculationPolicy:
    """Decides, step by step, whether the scheduler gives decodes their lookahead."""

    mode: Mode = "auto"
    min_samples: int = 6
    probe_every: int = 50  # steps off before "on" is measured again
    margin: float = 0.05
    alpha: float = 0.2
    lookahead: int = 0  # numSpeculativeTokens: a step yields at most 1 + lookahead tokens (0: unknown)
    enabled: bool = field(init=False)
    _on_step: _Ema = field(init=False, default_factory=_Ema)
    _on_tokens: _Ema = field(init=False, default_factory=_Ema)
    _off_step: _Ema = field(init=False, default_factory=_Ema)
    _since_switch: int = field(init=False, default=0)
    _probe_wait: int = field(init=False, default=0)  # steps off before the next probe
    _probing: bool = field(init=False, default=False)  # on because a probe switched it on

    def __post_init__(self) -> None:
        self.enabled = self.mode != "off"
        self._probe_wait = self.probe_every

    def observe(self, step_s: float, num_decodes: int, num_tokens: int, prefill: bool, drafted: bool) -> bool:
        """One finished step: its duration, how many sequences decoded, how many tokens they got,
        whether it also computed prefill, whether any decode carried drafts. Returns whether
        speculation should be on next step."""
        if self.mode == "auto":
            self._since_switch += 1
        if prefill or num_decodes <= 0 or step_s <= 0:
            return self.enabled
        # A step without drafts costs what a step with speculation off costs, whatever the state
        # (prompt lookup found no match): it measures "off" for free; only drafted steps measure "on".
        # Measured in every mode: the time-saved estimate needs the "off" cost too.
        if drafted:
            self._on_step.add(step_s, self.alpha)
            self._on_tokens.add(num_tokens / num_decodes, self.alpha)
        else:
            self._off_step.add(step_s, self.alpha)
        if self.mode != "auto":
            return self.enabled
        gain = self.gain()
        if gain is None:
            if self.enabled and self._on_step.samples >= self.min_samples:
                self._switch()  # "off" never measured (every step drafted): measure it
            return self.enabled
        # Even every draft accepted would not pay for such a step. Not judged on a probe's first drafted
        # step: a draft model feeds then what it missed while off.
        if (self.enabled and self.lookahead and self._on_step.samples >= 2
                and self._on_step.value > (1 + self.lookahead) * self._off_step.value):
            self._switch()
            return self.enabled
        if self.enabled and self._on_step.samples < self.min_samples:
            return self.enabled  # just switched on: let acceptance be measured afresh
        if not self.enabled and self._off_step.samples < self.min_samples:
            return self.enabled
        # Off as soon as it does not pay; on again only if it pays by `margin`: in doubt, off (a
        # probe every probe_every steps costs little; staying on at a gain of 0.95 costs 5%).
        if self.enabled and gain < 1.0 or not self.enabled and gain > 1 + self.margin:
            self._switch()
        elif not self.enabled and self._since_switch >= self._probe_wait:
            self._switch()  # acceptance can only be measured by drafting: probe "on" again
            self._probing = True
        elif self.enabled and self._probing:
            self._probing, self._probe_wait = False, self.probe_every  # the probe found a gain: it stays on
        return self.enabled

    def gain(self) -> float | None:
        """Measured decode rate with speculation over without (> 1: it pays); None until both are known."""
        if self._on_step.value is None or self._off_step.value is None or self._on_tokens.value is None:
            return None
        return (self._on_tokens.value / self._on_step.value) * self._off_step.value

    def saved_seconds(self, step_s: float, num_decodes: int, num_tokens: int) -> float | None:
        """Estimated time a drafted decode step saved (negative: lost) against speculation off:
        its sequences gained num_tokens / num_decodes tokens each, which without drafts would take
        that many steps at the measured plain step cost; minus what the step took. None until a
        plain step was measured."""
        if self._off_step.value is None or num_decodes <= 0:
            return None
        return num_tokens / num_decodes * self._off_step.value - step_s

    def _switch(self) -> None:
        self.enabled = not self.enabled
        self._since_switch = 0
        if not self.enabled and self._probing:  # a probe found it still losing: probe less often
            self._probe_wait = min(2 * self._probe_wait, self.probe_every * MAX_PROBE_BACKOFF)
        if not self.enabled:
            self._probing = False
        # Fresh sample counts for the state entered: the workload may have changed since it was left.
        if self.enabled:
            self._on_step, self._on_tokens = _Ema(self._on_step.value), _Ema(self._on_tokens.value)
        else:
            self._off_step = _Ema(self._off_step.value)


__all__ = ["SpeculationPolicy", "Mode"]
