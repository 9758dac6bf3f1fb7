"""The `auto` speculation policy: keep drafting only while it pays (pure; no I/O, no framework).

It watches decode steps (steps that carry no prefill chunk, so their cost is comparable) and
keeps two measurements: the step time with speculation off, and with it on together with the
tokens each sequence gains per step (1 + accepted drafts). Speculation pays when

    tokens_per_step_on / step_s_on  >  1 / step_s_off      (decode tokens per second per sequence)

Starting on, it measures `min_samples` steps in each state, then keeps the better one; the state
it left is re-measured every `probe_every` steps (acceptance changes with the workload). Switching
off needs the off rate to beat the on rate by `margin`, and back on the reverse, so noise does not
flap it. Modes `on` and `off` never change the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["on", "off", "auto"]


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
    min_samples: int = 8
    probe_every: int = 200
    margin: float = 0.05
    alpha: float = 0.2
    enabled: bool = field(init=False)
    _on_step: _Ema = field(init=False, default_factory=_Ema)
    _on_tokens: _Ema = field(init=False, default_factory=_Ema)
    _off_step: _Ema = field(init=False, default_factory=_Ema)
    _since_switch: int = field(init=False, default=0)
    _probing: bool = field(init=False, default=False)  # measuring the state it left; back unless it now wins

    def __post_init__(self) -> None:
        self.enabled = self.mode != "off"

    def observe(self, step_s: float, num_decodes: int, num_tokens: int, prefill: bool) -> bool:
        """One finished step: its duration, how many sequences decoded, how many tokens they got,
        whether it also computed prefill. Returns whether speculation should be on next step."""
        if self.mode != "auto":
            return self.enabled
        self._since_switch += 1
        if prefill or num_decodes <= 0 or step_s <= 0:
            return self.enabled
        if self.enabled:
            self._on_step.add(step_s, self.alpha)
            self._on_tokens.add(num_tokens / num_decodes, self.alpha)
        else:
            self._off_step.add(step_s, self.alpha)
        measured = (self._on_step if self.enabled else self._off_step).samples
        if measured < self.min_samples:
            return self.enabled
        if self._off_step.value is None or self._on_step.value is None:
            self._switch()  # the other state has never been measured
            return self.enabled
        gain = self.gain()
        assert gain is not None
        if self.enabled and gain < 1 - self.margin or not self.enabled and gain > 1 + self.margin:
            self._switch()
        elif self._probing:
            self._probing = False  # the probe confirmed the current state
        elif self._since_switch >= self.probe_every:
            self._switch(probe=True)
        return self.enabled

    def gain(self) -> float | None:
        """Measured decode rate with speculation over without (> 1: it pays); None until both are known."""
        if self._on_step.value is None or self._off_step.value is None or self._on_tokens.value is None:
            return None
        return (self._on_tokens.value / self._on_step.value) * self._off_step.value

    def _switch(self, probe: bool = False) -> None:
        self.enabled = not self.enabled
        self._since_switch = 0
        self._probing = probe
        # Fresh samples for the state entered: the workload may have changed since it was left.
        if self.enabled:
            self._on_step, self._on_tokens = _Ema(self._on_step.value), _Ema(self._on_tokens.value)
        else:
            self._off_step = _Ema(self._off_step.value)


__all__ = ["SpeculationPolicy", "Mode"]
