"""Any transformers causal LM whose attention goes through the attention interface: tiny random
models of several architectures, built here from their configs, served by the paged runner under
the real scheduler, give exactly `generate`'s greedy tokens (eager attention, its own KV cache),
under chunked prefill and preemption by recompute and by swap, with every block freed.

The models are small (2 layers, hidden 64, vocab 320) with `initializer_range=0.5`, so random
logits are far apart and token equality is not luck. Sliding windows are set far shorter than the
prompts (8 tokens), and Gemma 2 keeps its attention and final logit soft-capping, so each of those
code paths changes the output and is checked. Architectures the runner cannot serve are refused at
load, each with its reason (the config-only tests at the end).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from magnitude.runner.loading import ModelSourceError, check_servable  # noqa: E402

from magnitude.engine.sampling import SamplingParams  # noqa: E402

from .conftest import MAX_NEW, drive_scheduler, without_eos  # noqa: E402

from .tiny_models import ARCHS, VOCAB, build_tiny_model, tiny_config  # noqa: E402

PROMPT_LENGTHS = (1, 6, 19, 37, 70)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _reference(path: Path, prompts: list[list[int]], **overrides) -> list[list[int]]:
    """Greedy tokens from stock transformers: a separate load, eager attention (which, unlike SDPA,
    applies Gemma 2's soft-capping), its own KV cache, its own sliding-window masks."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                 **overrides).eval()
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=2,
                                 pad_token_id=0)
            gen = out[0, len(ids):].tolist()
            refs.append(gen[: gen.index(2) + 1] if 2 in gen else gen)
    return refs


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    from magnitude.runner import ModelRunner

    path = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    prompts = _prompts()
    runner = ModelRunner(str(path), device="cpu", dtype="float32", block_size=16, num_blocks=64,
                         num_swap_blocks=32, seed=0, num_threads=1)
    return request.param, path, runner, prompts, _reference(path, prompts)


@pytest.mark.model
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_architecture_matches_generate_under_chunking_and_preemption(tiny, mode):
    arch, _path, runner, prompts, refs = tiny
    run = drive_scheduler(
        runner, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
        f"scheduler.preemptionMode={mode}",
        "scheduler.prefillChunkSize=16",
        "scheduler.tokenBudget=64",
        "kvCache.numBlocks=8",  # the longest sequence needs 6: the others must make room
        f"kvCache.swapBlocks={runner.num_swap_blocks}",
        "kvCache.enablePrefixCaching=false",
    )
    expected = {f"r{i}": without_eos(ref, runner.eos_token_ids) for i, ref in enumerate(refs)}
    assert run.outputs == expected, arch
    stats = run.sched.stats()
    assert sum(n for (m, _reason), n in stats.preemptions.items() if m == mode) > 0, stats.preemptions
    assert stats.kv_used_blocks == 0 and stats.swap_used_blocks == 0


@pytest.mark.model
def test_generate_on_the_runners_own_model_object(tiny):
    """Without the paged batch the attention function falls back to plain attention, and still
    honours the window and soft-capping (transformers builds no mask for a custom function)."""
    _arch, _path, runner, prompts, refs = tiny
    ids = prompts[3]  # 37 tokens: past the 8-token window
    with torch.inference_mode():
        out = runner.model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=2,
                                    pad_token_id=0)[0, len(ids):].tolist()
    assert (out[: out.index(2) + 1] if 2 in out else out) == refs[3]


@pytest.mark.model
def test_the_window_and_soft_caps_change_the_output(tmp_path):
    """Without this the equality above could hold with a window or cap silently ignored."""
    prompts = _prompts()
    path = build_tiny_model("gemma2", tmp_path / "g2")
    capped = _reference(path, prompts)
    assert _reference(path, prompts, attn_logit_softcapping=None) != capped
    assert _reference(path, prompts, sliding_window=256) != capped
    path = build_tiny_model("mistral-sliding", tmp_path / "m")
    assert _reference(path, prompts, sliding_window=None) != _reference(path, prompts)


# -- refusals: config-only, no weights read -------------------------------------------------------


def _write_config(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")
    return path


def _refusal(path: Path) -> str:
    with pytest.raises(ModelSourceError) as e:
        check_servable(path)
    return str(e.value)


def test_trust_remote_code_is_refused(tmp_path):
    d = _write_config(tmp_path / "m", {**tiny_config("llama").to_dict(),
                                       "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}})
    assert "trust_remote_code" in _refusal(d)


def test_unknown_model_type_with_custom_code_is_refused(tmp_path):
    d = _write_config(tmp_path / "m", {"model_type": "my_custom_lm",
                                       "auto_map": {"AutoConfig": "configuration_x.XConfig"}})
    assert "cannot be served" in _refusal(d)


def test_pickle_weights_are_refused(tmp_path):
    d = tmp_path / "m"
    tiny_config("llama").save_pretrained(d)
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04")
    msg = _refusal(d)
    assert "pickle" in msg and "pytorch_model.bin" in msg


@pytest.mark.parametrize("model_type,extra,needle", [
    ("qwen3_next", {}, "linear_attention"),  # hybrid linear-attention layers
    ("mamba", {}, "linear_attention"),  # recurrent, no attention at all
    ("falcon", {}, "attention interface"),  # its own attention code, not the interface
    ("gemma3", {}, "Gemma3ForConditionalGeneration"),  # multimodal wrapper
    ("llama4_text", {"attention_chunk_size": 64}, "attention"),  # chunked attention
    ("deepseek_v3", {}, "latent attention"),
    ("llama", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "gptq"),
])
def test_unservable_architectures_are_refused_by_reason(tmp_path, model_type, extra, needle):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type).to_dict()
    cfg.update(extra)
    msg = _refusal(_write_config(tmp_path / "m", cfg))
    assert needle in msg, msg
