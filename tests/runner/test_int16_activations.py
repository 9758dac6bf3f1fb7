"""w4a16-int16 through the runner: the fused decode step against the lean forward, prompt rows taken
exactly as w4a16 takes them, decode rows as the int16 products, the LM head's rows in int16, the
refusal where Magnitude's kernels are not in use, and the real model's step. The kernels' own figures are in test_lowbit.py."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from magnitude.runner import lowbit  # noqa: E402
from magnitude.runner.paged_decoder import paged_decoder  # noqa: E402
from magnitude.runner.quant_eval import kernel_description  # noqa: E402
from magnitude.runner.quantize import Int4WeightOnlyLinear, QuantizationError  # noqa: E402

from .test_fused_decode import (DECODES, TINY_TOLERANCE, _both, _close_caches,  # noqa: E402
                                _marked_mixed_step, _native_or_skip, _rel, _tiny,
                                runner_w4a16)  # noqa: F401 (fixture)
from .test_paged_decoder import _runner  # noqa: E402
from .tiny_models import build_tiny_model, tiny_config  # noqa: E402

pytestmark = pytest.mark.model

# Fused against lean under w4a16-int16: the same int16 products (each linear's own call in the lean
# forward); the fp32 sums elsewhere (norms, attention) differ in order, and a value moved across an
# int16 rounding boundary moves its group's product by a step. Measured on AVX2: 3.3e-5 to 8.6e-5
# on the tiny models below (their random weights cross boundaries), 4.2e-5 on SmolLM2; bound about
# 10x that. (w4a8: 1e-2.) Losing the int16 flag in the fused step is caught bit for bit by
# test_the_fused_step_takes_prompt_rows_as_w4a16_and_decodes_in_int16.
W4A16_INT16_TOLERANCE = 1e-3


@pytest.mark.parametrize("arch,head_dim", [("llama", None), ("mistral-sliding", 64), ("qwen2-sliding", 128)])
def test_a_decode_step_matches_the_lean_forward(arch, head_dim, tmp_path):
    _native_or_skip()
    runner = _runner(_tiny(arch, tmp_path / arch, head_dim), quantization="w4a16-int16")
    got, want, fused_cache, lean_cache = _both(runner, DECODES)
    print(f"\n{arch} head_dim {head_dim or 16} w4a16-int16 fused vs lean: {_rel(got, want):.1e} "
          f"on {kernel_description('w4a16-int16')}")
    # > 0: the fused step ran (its sums are not the lean forward's), not the lean forward twice
    assert got.shape == want.shape and 0 < _rel(got, want) < W4A16_INT16_TOLERANCE
    _close_caches(fused_cache, lean_cache, W4A16_INT16_TOLERANCE)


def _set_activations(runner, kind: str) -> None:
    for m in runner.model.modules():
        if isinstance(m, Int4WeightOnlyLinear):
            m.activations = kind


def test_the_fused_step_takes_prompt_rows_as_w4a16_and_decodes_in_int16(tmp_path):
    """A mixed step (two decodes, a 23-token chunk, a 9-token prompt) with the chunk and prompt rows
    marked, through the fused step: the marked rows are bit for bit a w4a16 fused step's (the same
    codes, the module's activations switched to fp32), the decode rows bit for bit the unmarked
    step's, and those are int16's: they differ from w4a16's by its rounding. The lean forward under
    the same marks agrees with the fused step within W4A16_INT16_TOLERANCE."""
    _native_or_skip()
    runner = _runner(build_tiny_model("qwen2-sliding", tmp_path / "q"), quantization="w4a16-int16")
    plain, got, lean, on, _snapshot, step = _marked_mixed_step(runner)
    try:
        _set_activations(runner, "fp32")
        with torch.inference_mode():
            w4a16 = paged_decoder(runner.model.model)(*step).clone()
    finally:
        _set_activations(runner, "int16")
    print(f"\ndecode rows vs w4a16: {_rel(got[~on], w4a16[~on]):.1e}, fused vs lean: {_rel(got, lean):.1e} "
          f"on {kernel_description('w4a16-int16')}")
    assert torch.equal(got[on], w4a16[on])
    assert torch.equal(got[~on], plain[~on])
    assert not torch.equal(got[~on], w4a16[~on]) and _rel(got[~on], w4a16[~on]) > TINY_TOLERANCE / 10
    assert 0 < _rel(got, lean) < W4A16_INT16_TOLERANCE


def test_the_runner_marks_prompt_rows_for_w4a16_int16(tmp_path, monkeypatch):
    """ModelRunner marks a step's prompt rows for w4a16-int16 (as for w4a16-bf16prefill): a step
    with a prompt runs under its marks, a decode-only step under none."""
    from magnitude.runner.calibration import _plan

    _native_or_skip()
    runner = _runner(build_tiny_model("llama", tmp_path / "l"), quantization="w4a16-int16")
    marked: list[np.ndarray] = []
    original = lowbit.prompt_rows

    def recording(rows):
        marked.append(rows.copy())
        return original(rows)

    monkeypatch.setattr(lowbit, "prompt_rows", recording)
    runner.execute(_plan(1, 7, 5, runner.block_size, 0))  # a decode beside a 7-token prompt
    assert len(marked) == 1 and marked[0].tolist() == [0] + [1] * 7
    runner.execute(_plan(2, 0, 5, runner.block_size, 1))  # two decodes
    assert len(marked) == 1


def test_the_lm_head_multiplies_int16_rows_under_w4a16_int16(tmp_path):
    """w4a16-int16's LM head is w4a16's int8 head (the same codes) taking its rows in int16; a step's
    logits are that product of its hidden rows, whatever the step's rows are (a decode's, a prompt's
    last), while w4a16's head stays fp32."""
    from magnitude.runner.calibration import _plan
    from magnitude.runner.quantize import Int8GroupLinear

    _native_or_skip()
    config = tiny_config("llama")
    config.tie_word_embeddings = True
    path = build_tiny_model("llama", tmp_path / "tied", config=config)
    runner, w4a16 = _runner(path, quantization="w4a16-int16"), _runner(path, quantization="w4a16")
    head = runner.model.lm_head
    assert type(head) is Int8GroupLinear and head.activations == "int16"
    assert w4a16.model.lm_head.activations == "fp32" and torch.equal(head.qweight, w4a16.model.lm_head.qweight)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = head.register_forward_hook(lambda _m, args, out: seen.append((args[0].detach().clone(), out.detach().clone())))
    try:
        runner.execute(_plan(1, 7, 5, runner.block_size, 0))  # a decode beside a 7-token prompt
    finally:
        hook.remove()
    (rows, logits), = seen
    flat = rows.reshape(-1, rows.shape[-1]).float().contiguous()
    assert flat.shape[0] >= 2
    assert torch.equal(logits.reshape(flat.shape[0], -1),
                       lowbit.kernels().int8gq16_matmul(flat, head.qweight, head.scales))
    rounding = _rel(head(flat), w4a16.model.lm_head(flat))  # int16's step, not summation order's 1e-7
    print(f"\nint16 head vs fp32 head: {rounding:.1e} on {kernel_description('w4a16-int16')}")
    assert 5e-6 < rounding < 1e-3


def test_w4a16_int16_is_refused_by_name_where_the_kernels_are_not_in_use(tmp_path, monkeypatch):
    """No torch fallback: with torch's kernels chosen the load fails naming the method."""
    monkeypatch.setenv(lowbit.KERNEL_ENV, "torch")
    with pytest.raises(QuantizationError, match="w4a16-int16 runs on Magnitude's low-bit kernels only.*use w4a16"):
        _runner(build_tiny_model("llama", tmp_path / "l"), quantization="w4a16-int16")


def test_the_real_models_w4a16_int16_decode_step(runner_w4a16):
    """SmolLM2 with its products switched to int16 activations (the w4a16 runner's codes): fused
    against lean within W4A16_INT16_TOLERANCE over 30 layers, and int16 rounding visibly there
    against w4a16 yet far below w4a8's (1.3e-2 on AVX2, test_fused_decode)."""
    runner = runner_w4a16
    seqs = [([60 + b for b in table], cached, n) for table, cached, n in DECODES]
    _a16, a16_lean, _f, _l = _both(runner, seqs, seed=2)
    try:
        _set_activations(runner, "int16")
        got, want, fused_cache, lean_cache = _both(runner, seqs, seed=2)
    finally:
        _set_activations(runner, "fp32")
    print(f"\nSmolLM2 w4a16-int16 fused vs lean: {_rel(got, want):.1e}; vs w4a16 (lean): {_rel(want, a16_lean):.1e} "
          f"on {kernel_description('w4a16-int16')}")
    assert 0 < _rel(got, want) < W4A16_INT16_TOLERANCE
    _close_caches(fused_cache, lean_cache, W4A16_INT16_TOLERANCE)
    assert 1e-5 < _rel(want, a16_lean) < 1e-3
