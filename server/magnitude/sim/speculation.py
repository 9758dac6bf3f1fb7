"""Speculative decoding in the simulator: acceptance, draft cost and the on/off/auto decision.

The config's `draftModel` (method, numSpeculativeTokens, mode) is simulated without a model:

- **Acceptance.** Each draft of a decode is accepted with probability `a` (a per-trace default,
  or one per priority class), independently, until the first rejection; the decode then gains
  1 + accepted tokens (the target's own token at the first mismatch, or the bonus after all k).
  So the expected tokens per target step are E = (1 - a^(k+1)) / (1 - a) (k + 1 at a = 1); the
  acceptance the engine's metrics report (accepted / proposed) is (E - 1) / k. Draws come from a
  generator seeded by (seed, request id): a request's draws do not depend on what shares its steps,
  and a run is reproducible.
- **Cost.** The verify cost is the cost model's own: a decode's lookahead slots count as
  prefill-like tokens (`cost.plan_shape`). The draft cost: prompt lookup (`ngram`) is free; a
  draft model (`draft`) adds `draft_step_seconds` per lookahead position (one draft forward per
  position for the whole batch, as the runner does), a measured or configured figure.
- **Mode.** `on` and `off` fix it; `auto` feeds every simulated step to the same
  `engine/speculation.py` `SpeculationPolicy` object the engine uses, and applies its decision to
  the scheduler (`set_speculation`), as the engine does.

`SpecSimulation` is the hook `simulate` calls; `SpecStats` is what the report prints.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from magnitude.engine.output import RunnerOutput, SampledToken, StepPlan
from magnitude.engine.speculation import Mode, SpeculationPolicy
from magnitude.policy.schema import EngineConfig
from magnitude.sim.cost import CostModel, replay_step_seconds


class SpecConfigError(ValueError):
    """A speculation knob the simulator cannot use (named in the message)."""


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """Expected tokens a decode gains per target step with k drafts each accepted with probability
    `acceptance` until the first rejection: 1 + a + a^2 + ... + a^k."""
    if k <= 0:
        return 1.0
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass(frozen=True)
class SpecModel:
    """The knobs: per-draft acceptance probability (default and per class), draft cost, seed."""

    acceptance: float = 0.6
    per_class: dict[str, float] = field(default_factory=dict)
    draft_step_seconds: float | None = None  # per draft forward; required for method draft
    seed: int = 0

    def __post_init__(self) -> None:
        for name, a in [("acceptance", self.acceptance), *((f"acceptance {c}", v) for c, v in self.per_class.items())]:
            if not 0.0 <= a <= 1.0:
                raise SpecConfigError(f"--spec-acceptance: {name} must be within 0..1, got {a}")
        if self.draft_step_seconds is not None and self.draft_step_seconds < 0:
            raise SpecConfigError(f"--spec-draft-seconds must be >= 0, got {self.draft_step_seconds}")

    def acceptance_of(self, priority_class: str) -> float:
        return self.per_class.get(priority_class, self.acceptance)


@dataclass
class SpecStats:
    mode: Mode
    method: str
    num_speculative_tokens: int
    proposed: int = 0
    accepted: int = 0
    drafted_decodes: int = 0  # decodes that carried drafts (target steps, per sequence)
    drafted_steps: int = 0
    switches: int = 0
    draft_seconds: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode, "method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
            "proposed": self.proposed, "accepted": self.accepted,
            "acceptance": round(self.accepted / self.proposed, 4) if self.proposed else None,
            "tokens_per_step": round(1 + self.accepted / self.drafted_decodes, 4) if self.drafted_decodes else None,
            "drafted_steps": self.drafted_steps, "switches": self.switches,
            "draft_seconds": round(self.draft_seconds, 6),
        }


class SpecSimulation:
    """Stands in for the runner's drafting and verification, and the engine's auto policy."""

    def __init__(self, config: EngineConfig, cost_model: CostModel, model: SpecModel, classes: dict[str, str]) -> None:
        draft = config.draft_model
        if draft is None:
            raise SpecConfigError("speculation knobs given but the config has no draftModel")
        if draft.method == "draft" and model.draft_step_seconds is None:
            raise SpecConfigError("draftModel.method draft: give the draft model's cost per draft forward "
                                  "(--spec-draft-seconds, e.g. measured by `magnitude profile` on the draft)")
        if draft.method != "draft" and model.draft_step_seconds is not None:
            raise SpecConfigError(f"--spec-draft-seconds applies to draftModel.method draft only (this config: "
                                  f"{draft.method}, whose drafts cost nothing to propose)")
        self.cost_model = cost_model
        self.model = model
        self.draft_step_seconds = model.draft_step_seconds or 0.0
        self.policy = SpeculationPolicy(draft.mode, lookahead=draft.num_speculative_tokens)  # the engine's own
        self.classes = classes  # request id -> priority class
        self.stats = SpecStats(draft.mode, draft.method, draft.num_speculative_tokens)
        self._rngs: dict[str, random.Random] = {}

    def _rng(self, request_id: str) -> random.Random:
        rng = self._rngs.get(request_id)
        if rng is None:
            rng = self._rngs[request_id] = random.Random(f"{self.model.seed}:{request_id}")
        return rng

    def execute(self, plan: StepPlan) -> RunnerOutput:
        """A step: 1 + accepted tokens per drafted decode, one per other sampling row; the cost
        model's duration plus the draft forwards'."""
        out = RunnerOutput()
        positions = 0
        for s in plan.seqs:
            if not s.sample:
                continue
            n = 1
            if len(s.token_ids) == 1 and s.num_lookahead > 0:
                a = self.model.acceptance_of(self.classes.get(s.request_id, ""))
                rng = self._rng(s.request_id)
                accepted = 0
                while accepted < s.num_lookahead and rng.random() < a:
                    accepted += 1
                n += accepted
                out.num_drafts[s.request_id] = s.num_lookahead
                positions = max(positions, s.num_lookahead)
                self.stats.proposed += s.num_lookahead
                self.stats.accepted += accepted
                self.stats.drafted_decodes += 1
            out.sampled[s.request_id] = [SampledToken(1000 + (s.num_output_tokens + i) % 1000) for i in range(n)]
        draft_s = positions * self.draft_step_seconds
        self.stats.draft_seconds += draft_s
        self.stats.drafted_steps += bool(out.num_drafts)
        out.duration_s = replay_step_seconds(self.cost_model, plan) + draft_s
        return out

    def after_step(self, scheduler: object, plan: StepPlan, output: RunnerOutput) -> None:
        """The engine's `_observe_speculation`: the step's decodes and tokens to the policy, its
        decision to the scheduler."""
        decodes = tokens = 0
        prefill = False
        for s in plan.seqs:
            sampled = output.sampled.get(s.request_id)
            if s.sample and len(s.token_ids) == 1 and sampled:
                decodes += 1
                tokens += len(sampled)
            elif len(s.token_ids) > 1 or not s.sample:
                prefill = True
        was = self.policy.enabled
        on = self.policy.observe(output.duration_s, decodes, tokens, prefill=prefill, drafted=bool(output.num_drafts))
        if on != was:
            self.stats.switches += 1
            scheduler.set_speculation(on)  # type: ignore[attr-defined]





def spec_simulation(config: EngineConfig, cost_model: CostModel, model: SpecModel | None,
                    classes: dict[str, str]) -> SpecSimulation | None:
    """The hook for a run: None without draftModel; refused by name when the config and the knobs
    disagree (a draftModel without an acceptance to simulate, or knobs without a draftModel)."""
    if config.draft_model is None:
        if model is not None:
            raise SpecConfigError("--spec-acceptance / --spec-draft-seconds: the config has no draftModel "
                                  "(set draftModel.method and draftModel.numSpeculativeTokens)")
        return None
    if model is None:
        raise SpecConfigError("draftModel: give the acceptance to simulate (--spec-acceptance A, per draft, 0..1; "
                              "or CLASS=A per priority class)")
    return SpecSimulation(config, cost_model, model, classes)
__all__ = ["SpecModel", "SpecSimulation", "SpecStats", "SpecConfigError", "expected_tokens_per_step", "spec_simulation"]
