"""Prompt lookup through the real server: `magnitude serve`'s flags, the response's
`timing.spec_acceptance`, the spec-decode metrics, and the same answer with speculation off.

One real SmolLM2 server with `draftModel: {method: ngram, mode: on}` (the shared model_server has
no draft); the CLI refusals run `magnitude serve` as a process and exit before loading.
"""

from __future__ import annotations

import subprocess
from typing import Iterator

import openai
import pytest

from magnitude.policy.schema import EngineConfig

from .conftest import RunningServer, serve
from .test_serve_cli import env, serve_cmd

PASSAGE = ("The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp, and wrote the "
           "weather in his logbook: wind from the west, light rain, three ships sighted before nightfall.")
COPY_PROMPT = f"Copy the passage exactly.\n\nPassage: {PASSAGE}\n\nCopy: {PASSAGE}\n\nCopy again: The lighthouse"


@pytest.mark.parametrize("args, named", [
    (["--draft-model", "/nowhere/draft"], "draftModel.source /nowhere/draft: model source '/nowhere/draft': no such"),
    (["--draft-model", "self:two"], "draftModel.source self:two: self:N needs a layer count N >= 1"),
    (["--draft-model", "hf://org"], "draftModel.source hf://org: model source 'hf://org': expected hf://org/name"),
    (["--draft-model", "ngram", "--num-speculative-tokens", "8", "--set", "scheduler.maxLookaheadTokens=4"],
     "--num-speculative-tokens: 8 exceeds scheduler.maxLookaheadTokens 4"),
    (["--speculation", "on"], "--speculation needs --draft-model"),
    (["--set", "draftModel.source=package:no-such-draft"], "draftModel.source package:no-such-draft: "),
    (["--set", "draftModel.source=self:4", "--set", "draftModel.revision=v1"],
     "draftModel.revision applies only to hf:// sources, not self:4"),
    (["--draft-model", "self:4", "--draft-quantization", "w8a16"],
     "draftModel.quantization applies to a loaded draft model only, not ngram or self:N"),
    (["--draft-quantization", "w8a16"], "--draft-quantization needs --draft-model"),
    (["--draft-model", "ngram", "--runner", "simulated"], "simulated runner does not model speculation"),
])
def test_serve_refuses_what_it_cannot_speculate_with_exit_2(args: list[str], named: str) -> None:
    r = subprocess.run(serve_cmd(*args), env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and named in r.stderr, r.stderr


@pytest.fixture(scope="module")
def spec_server() -> Iterator[RunningServer]:
    pytest.importorskip("torch")
    from magnitude.runner import ModelRunner
    from magnitude.runner.spec_decode import NgramProposer

    config = EngineConfig.model_validate({"kvCache": {"numBlocks": 256, "enablePrefixCaching": False},
                                          "draftModel": {"method": "ngram", "mode": "on", "numSpeculativeTokens": 4}})
    load = lambda progress: ModelRunner(num_blocks=256, progress=progress, draft_proposer=NgramProposer())  # noqa: E731
    with serve(load, config) as s:
        yield s


def _complete(s: RunningServer) -> tuple[str, dict]:
    c = openai.OpenAI(base_url=s.v1, api_key="x")
    model = c.models.list().data[0].id
    r = c.completions.create(model=model, prompt=COPY_PROMPT, max_tokens=24, temperature=0,
                             extra_body={"priority_class": "interactive"})
    return r.choices[0].text, r.model_extra["timing"]  # type: ignore[index]


def test_prompt_lookup_answers_as_without_it_and_reports_acceptance(spec_server: RunningServer) -> None:
    name = "magnitude_spec_decode_{}_total"
    assert spec_server.metric("magnitude_spec_decode_enabled", method="ngram") == 1
    text, timing = _complete(spec_server)
    assert timing["spec_acceptance"] is not None and timing["spec_acceptance"] > 0.5, timing
    assert timing["max_burst_tokens"] > 1
    proposed = spec_server.metric(name.format("draft_tokens"), priority_class="interactive", method="ngram")
    accepted = spec_server.metric(name.format("accepted_tokens"), priority_class="interactive", method="ngram")
    assert 0 < accepted <= proposed
    assert accepted / proposed == pytest.approx(timing["spec_acceptance"], abs=1e-3)
    spec_server.engine.loop.scheduler.set_speculation(False)  # as auto would turn it off
    try:
        plain, plain_timing = _complete(spec_server)
    finally:
        spec_server.engine.loop.scheduler.set_speculation(True)
    assert plain == text
    assert plain_timing["spec_acceptance"] is None and plain_timing["max_burst_tokens"] == 1


def test_json_schema_with_penalties_under_prompt_lookup_answers_as_without_it(spec_server: RunningServer) -> None:
    """A grammar-constrained, penalised request drafts too (issue 14), over HTTP: same text as with
    speculation off, a valid contract, drafts accepted and tokens per target step counted."""
    record = '{"name": "Ada Lovelace", "city": "London", "born": 1815}'
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "born": {"type": "integer"}},
              "required": ["name", "city", "born"], "additionalProperties": False}
    c = openai.OpenAI(base_url=spec_server.v1, api_key="x")
    model = c.models.list().data[0].id

    def ask() -> tuple[str, dict]:
        r = c.chat.completions.create(
            model=model, max_tokens=40, temperature=0, frequency_penalty=0.2,
            messages=[{"role": "user", "content": f"Record: {record}\nRepeat the record as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
            extra_body={"priority_class": "batch"})
        return r.choices[0].message.content, r.model_extra["timing"]  # type: ignore[index]

    text, timing = ask()
    assert timing["output_contract"] == "valid", (text, timing)
    assert timing["spec_acceptance"] is not None and timing["spec_acceptance"] > 0, timing
    steps = spec_server.metric("magnitude_spec_decode_tokens_per_step_count", priority_class="batch", method="ngram")
    assert steps > 0
    spec_server.engine.loop.scheduler.set_speculation(False)
    try:
        plain, plain_timing = ask()
    finally:
        spec_server.engine.loop.scheduler.set_speculation(True)
    assert plain == text and plain_timing["spec_acceptance"] is None
