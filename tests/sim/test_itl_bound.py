"""The ITL promise per step: with `itlTargetMs`, no step that carries decodes is predicted over the
target — the decodes plus every prefill chunk in it, on the linear model and on a measured table —
and the defaults derived with nothing set keep the default target too."""

from __future__ import annotations

import pytest

from magnitude.policy.load import resolve_config
from magnitude.sim.cost import LinearCost, TableCost, efficient_prefill_step
from magnitude.sim.scenarios import ScenarioOptions, generate
from magnitude.sim.simulate import SimResult, simulate
from magnitude.sim.trace import TraceRecord

# The shape `magnitude profile` / the engine's calibration writes (decodes x prefill tokens at a
# 256-token context), with the kind of numbers SmolLM2 fp32 gives on two CPU cores: not linear.
MEASURED = TableCost(
    decode_batch_sizes=(0.0, 1.0, 4.0, 16.0),
    prefill_tokens=(0.0, 16.0, 64.0, 256.0),
    seconds=((1e-6, 0.030, 0.062, 0.205),
             (0.024, 0.046, 0.078, 0.221),
             (0.036, 0.058, 0.089, 0.236),
             (0.071, 0.094, 0.126, 0.268)),
)
# The same with the calibration's attention figures: decodes of long documents and chunks deep in a
# 3,000-token prompt cost more than the table's shape says, and the bound must see it.
WITH_ATTENTION = TableCost(decode_batch_sizes=MEASURED.decode_batch_sizes, prefill_tokens=MEASURED.prefill_tokens,
                           seconds=MEASURED.seconds, per_decode_context_token=5e-6, per_attention_pair=2e-7)


def documents() -> list[TraceRecord]:
    """Chats decoding when four 3,000-token documents arrive at once: several prompts in one step."""
    chats = [TraceRecord(id=f"chat-{i}", arrival=0.05 * i, prompt_tokens=60, output_tokens=120) for i in range(12)]
    docs = [TraceRecord(id=f"doc-{i}", arrival=1.0, prompt_tokens=3000, output_tokens=8) for i in range(4)]
    return chats + docs


def run(scenario: str, cost, *sets: str, n: int = 60) -> SimResult:
    config = resolve_config(None, list(sets))
    trace = documents() if scenario == "documents" else generate(scenario, ScenarioOptions(n=n))
    return simulate(trace, config, cost)


def decoding_steps(result: SimResult) -> list:
    return [s for s in result.steps if s.decode]


@pytest.mark.parametrize("cost", [LinearCost(), MEASURED, WITH_ATTENTION], ids=["linear", "measured", "attention"])
@pytest.mark.parametrize("scenario", ["documents", "long-prompt", "mixed"])
def test_no_step_with_decodes_is_predicted_over_the_target(cost, scenario: str) -> None:
    # The case: a big budget and a derived chunk; several prompts share a step.
    result = run(scenario, cost, "scheduler.tokenBudget=8192", "scheduler.itlTargetMs=150")
    steps = decoding_steps(result)
    assert len(steps) > 30
    worst = max(s.duration for s in steps)
    assert worst <= 0.150 + 1e-9, worst
    # Prefill still rides along with the decodes (what they leave), not only in steps of its own.
    assert sum(1 for s in steps if s.prefill) > 5
    assert all(r.status.is_terminal for _, r in result.requests)


@pytest.mark.parametrize("cost", [LinearCost(), MEASURED], ids=["linear", "measured"])
def test_a_chunk_bound_alone_lets_steps_run_over(cost) -> None:
    """The peer: the same budget with a per-sequence chunk only (2,800: what the old rule derived for
    150 ms); a step with several documents' chunks goes far over (0.31 s on the linear model)."""
    result = run("documents", cost, "scheduler.tokenBudget=8192", "scheduler.prefillChunkSize=2800")
    assert max(s.duration for s in decoding_steps(result)) > 0.300


@pytest.mark.parametrize("cost", [LinearCost(), MEASURED], ids=["linear", "measured"])
def test_derived_defaults_keep_the_derived_target(cost) -> None:
    result = run("long-prompt", cost)
    sp = result.config.scheduler
    assert sp.itl_target_ms == efficient_prefill_step(cost, sp.max_sequences)[1]
    assert sp.token_budget > 0 and 0 < sp.prefill_chunk_size <= sp.token_budget
    assert max(s.duration for s in decoding_steps(result)) <= sp.itl_target_ms / 1000.0 + 1e-9
