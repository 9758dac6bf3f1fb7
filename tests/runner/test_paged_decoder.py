"""The runner's lean forward (runner/paged_decoder.py) against transformers' own forward on the
same model object and the same paged batch: the hidden states must be equal bit for bit, for every
weight format the runner serves and for each family it covers (Llama, Mistral, Qwen2, windows
included), on a step that mixes decodes at several contexts, a chunk deep in a prompt whose blocks
are scattered (the gather path) and a prompt from position 0. Any other architecture keeps
transformers' forward."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from magnitude.runner.attention import SeqSlice, build_paged_batch  # noqa: E402
from magnitude.runner.paged_decoder import lean_family, lean_forward, paged_decoder, transformers_decoder  # noqa: E402
from magnitude.runner.quant_eval import isa_description  # noqa: E402

from .tiny_models import ARCHS, VOCAB, build_tiny_model  # noqa: E402

BLOCK = 16
# (block table, tokens already in the cache, tokens this step): decodes at contexts 5 and 40, a
# 23-token chunk at position 150 over scattered blocks, a fresh 9-token prompt: three attention
# groups (the chunk's context is too long to share the prompt's bucket).
SEQS = [([0], 5, 1), ([1, 2, 4], 40, 1), ([10, 3, 12, 5, 14, 7, 16, 6, 18, 11, 22], 150, 23), ([20], 0, 9)]


def _step(runner, seqs, new: bool, gen: torch.Generator):
    """Input ids, positions and paged batch for `seqs`: their cached prefixes (new=False) or the
    step on top of them (new=True)."""
    slices, ids, pos, offset = [], [], [], 0
    for table, cached, n in seqs:
        start, count = (cached, n) if new else (0, cached)
        if not count:
            continue
        slices.append(SeqSlice(offset, count, start, table))
        ids += torch.randint(4, VOCAB, (count,), generator=gen).tolist()
        pos += list(range(start, start + count))
        offset += count
    batch = build_paged_batch(slices, BLOCK, runner.kv.k_layers, runner.kv.v_layers, runner.device)
    return torch.tensor([ids]), torch.tensor([pos]), batch


LEAN_ARCHS = ["llama", "mistral", "mistral-sliding", "qwen2", "qwen2-sliding"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def _runner(path, dtype: str = "float32", quantization: str = "none", kv_cache_dtype: str = "float32"):
    """A runner over a 32-block pool; an fp32 pool unless asked (a quantized model's default is float16)."""
    from magnitude.runner import ModelRunner

    return ModelRunner(str(path), device="cpu", dtype=dtype, block_size=BLOCK, num_blocks=32, seed=0,
                       num_threads=1, quantization=quantization, evaluate_quantization=False, warmup=False,
                       kv_cache_dtype=kv_cache_dtype)


def _compare(runner, seed: int = 0, seqs=SEQS) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(lean, transformers) hidden states of the same mixed step, and its attention group count."""
    inner = runner.model.model
    family = lean_family(inner)
    assert family is not None
    # The lean forward itself: paged_decoder may hand a w4a16 model's short steps to the fused
    # native step (runner/fused_decode.py), which tests/runner/test_fused_decode.py compares with this.
    lean = lambda ids, pos, batch: lean_forward(inner, family, ids, pos, batch)  # noqa: E731
    reference_forward = transformers_decoder(runner.model.model)
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        reference_forward(*_step(runner, seqs, False, gen))  # the prefixes into the cache
        step = _step(runner, seqs, True, gen)
        reference = reference_forward(*step).clone()
        return lean(*step), reference, len(step[2].groups)


@pytest.mark.model
@pytest.mark.parametrize("dtype,quantization", [("float32", "none"), ("float32", "w4a16"), ("float32", "w8a16"),
                                                ("float32", "w8a8"), ("bfloat16", "none")])
def test_lean_forward_is_bit_identical_to_transformers(tiny_llama, dtype, quantization):
    got, reference, groups = _compare(_runner(tiny_llama, dtype, quantization))
    print(f"\n{dtype} {quantization}: {groups} attention groups on {isa_description()}")
    assert groups >= 3 and got.shape == reference.shape
    assert torch.equal(got, reference), (got - reference).abs().max()


@pytest.mark.model
@pytest.mark.parametrize("arch", LEAN_ARCHS[1:])
def test_each_lean_family_is_bit_identical_windows_included(arch, tmp_path):
    """Mistral and Qwen2, with and without their sliding windows (8 tokens, far shorter than the
    step's contexts, so a window the lean forward dropped would change the output)."""
    got, reference, _groups = _compare(_runner(build_tiny_model(arch, tmp_path / arch)))
    assert torch.equal(got, reference), (arch, (got - reference).abs().max())


@pytest.mark.model
def test_the_real_models_step_is_bit_identical(runner):
    """SmolLM2 (fp32, the session's runner): the same mixed step through both forwards."""
    got, reference, _groups = _compare(runner, 1, [([60 + b for b in table], cached, n) for table, cached, n in SEQS])
    assert torch.equal(got, reference)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in LEAN_ARCHS])
def test_other_architectures_keep_transformers_forward(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from magnitude.runner.attention import ATTN_IMPLEMENTATION

    from .tiny_models import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation=ATTN_IMPLEMENTATION)
    assert lean_family(model.model) is None
    assert paged_decoder(model.model).__name__ == "transformers_forward"


def test_a_subclassed_llama_layer_is_not_taken_for_a_plain_one():
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    from magnitude.runner.attention import ATTN_IMPLEMENTATION

    from .tiny_models import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=ATTN_IMPLEMENTATION)
    assert lean_family(model.model) is not None

    class Patched(modeling_llama.LlamaMLP):
        pass

    model.model.layers[1].mlp.__class__ = Patched
    assert lean_family(model.model) is None


def test_a_llama_set_to_another_attention_keeps_transformers_forward():
    from transformers import AutoModelForCausalLM

    from .tiny_models import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    assert lean_family(model.model) is None
