"""Small factories for scheduler tests: configs from `--set` style overrides, requests, fake runner output."""

from __future__ import annotations

from magnitude.engine.output import RunnerOutput, SampledToken, StepPlan
from magnitude.engine.request import Request
from magnitude.engine.sampling import SamplingParams
from magnitude.engine.scheduler import Scheduler
from magnitude.policy.load import resolve_config


def make_scheduler(*sets: str, num_blocks: int | None = None) -> Scheduler:
    return Scheduler(resolve_config(None, list(sets)), num_blocks=num_blocks)


def make_request(rid: str, prompt: int | list[int], outputs: int, arrival: float = 0.0, **kw) -> Request:
    ids = prompt if isinstance(prompt, list) else None
    n = len(prompt) if isinstance(prompt, list) else prompt
    return Request(rid, ids, n, SamplingParams(max_tokens=outputs, ignore_eos=True), arrival, **kw)


def fake_output(plan: StepPlan, token: int = 7) -> RunnerOutput:
    """The runner's answer: one token for every sequence that samples."""
    return RunnerOutput(sampled={s.request_id: [SampledToken(token)] for s in plan.seqs if s.sample})


def shape(plan: StepPlan) -> list[tuple[str, int, bool]]:
    """(request, tokens, samples) per scheduled sequence: decodes first, then chunks."""
    return [(s.request_id, s.num_tokens, s.sample) for s in plan.seqs]
