"""A draft model through the real server: `magnitude serve --draft-model` refusing a draft whose
tokenizer differs (exit 2 with the reason, after the target loaded), and a real SmolLM2 server with
a self-draft (`self:24`) answering as without speculation, reporting acceptance and the draft
method's metrics, and serving on without speculation once its draft fails at run time.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from typing import Iterator

import openai
import pytest

from magnitude.policy.schema import EngineConfig

from .conftest import RunningServer, free_port, serve
from .test_serve_cli import env, serve_cmd
from .test_spec_serve import COPY_PROMPT

pytestmark = pytest.mark.model


def _tiny_models():
    """tests/runner/tiny_models.py (random-weight models with their own word-level tokenizer)."""
    path = Path(__file__).resolve().parents[1] / "runner" / "tiny_models.py"
    spec = importlib.util.spec_from_file_location("tiny_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_a_draft_with_another_tokenizer_exits_2_with_the_reason(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    draft = _tiny_models().build_tiny_model("llama", tmp_path / "word-level-draft")
    r = subprocess.run(serve_cmd("--draft-model", str(draft), "--port", str(free_port())),
                       env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"draft model {draft}: its tokenizer differs from the target's" in r.stderr


@pytest.fixture(scope="module")
def draft_server() -> Iterator[RunningServer]:
    pytest.importorskip("torch")
    from magnitude.runner import ModelRunner

    config = EngineConfig.model_validate({"kvCache": {"numBlocks": 256, "enablePrefixCaching": False},
                                          "draftModel": {"method": "draft", "source": "self:24", "mode": "on",
                                                         "numSpeculativeTokens": 3}})
    load = lambda progress: ModelRunner(num_blocks=256, progress=progress, draft_source="self:24")  # noqa: E731
    with serve(load, config) as s:
        yield s


def _complete(s: RunningServer) -> tuple[str, dict]:
    c = openai.OpenAI(base_url=s.v1, api_key="x")
    model = c.models.list().data[0].id
    r = c.completions.create(model=model, prompt=COPY_PROMPT, max_tokens=16, temperature=0,
                             extra_body={"priority_class": "interactive"})
    return r.choices[0].text, r.model_extra["timing"]  # type: ignore[index]


class _Exploding:
    def __call__(self, **kwargs):
        raise RuntimeError("draft kernel crashed")


def test_a_self_draft_answers_as_without_it_and_survives_its_own_failure(draft_server: RunningServer) -> None:
    s = draft_server
    assert s.metric("magnitude_spec_decode_enabled", method="draft") == 1
    text, timing = _complete(s)
    assert timing["spec_acceptance"] is not None, timing
    proposed = s.metric("magnitude_spec_decode_draft_tokens_total", priority_class="interactive", method="draft")
    accepted = s.metric("magnitude_spec_decode_accepted_tokens_total", priority_class="interactive", method="draft")
    assert 0 < proposed and 0 <= accepted <= proposed
    s.engine.loop.scheduler.set_speculation(False)
    try:
        plain, plain_timing = _complete(s)
    finally:
        s.engine.loop.scheduler.set_speculation(True)
    assert plain == text and plain_timing["spec_acceptance"] is None

    s.engine.runner.draft_proposer.parts.decoder = _Exploding()  # the draft breaks while serving
    after, after_timing = _complete(s)
    assert after == text
    assert after_timing["spec_acceptance"] is None
    assert s.metric("magnitude_spec_decode_enabled", method="draft") == 0
    again, _ = _complete(s)  # and it stays off: no lookahead is budgeted any more
    assert again == text and not s.engine.loop.scheduler.speculating
