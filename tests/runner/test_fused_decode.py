"""The fused step (runner/fused_decode.py, `magnitude_decode_layers`) against the lean forward on the
same w4a16 (or w4a8) model and the same paged batch: decode steps at several contexts over scattered blocks,
and a step with short chunks, per family (Llama; Mistral and Qwen2 with 8-token windows; Qwen2's q/k/v
biases). It sums in its own order, so hidden states agree to fp32 rounding, not bit for bit; the
K/V it writes into the pool must be the lean forward's. A bf16 model's fused step is its weights
run in fp32: it must match the lean forward of an fp32 copy of the model, not the bf16 forward. A
row's result must not depend on the rows batched with it or on the thread count. Steps with a long
chunk, and models it does not run, keep the lean forward. Tests print the CPU and kernel build."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest

torch = pytest.importorskip("torch")

from magnitude.runner import lowbit  # noqa: E402
from magnitude.runner.attention import SeqSlice, build_paged_batch  # noqa: E402
from magnitude.runner.fused_decode import (FUSED_BOUNDS_W4A16, FUSED_MAX_CHUNK_KEYS,  # noqa: E402
                                           FUSED_MAX_CHUNK_KEYS_W4A16, FUSED_MAX_CHUNK_ROWS,
                                           FUSED_MAX_CHUNK_ROWS_DENSE_BF16, FUSED_MAX_CHUNK_ROWS_W4A16,
                                           FUSED_MAX_CHUNK_ROWS_W4A16_AVX2,
                                           fused_decoder, runs_fused)
from magnitude.runner.paged_decoder import lean_family, lean_forward, paged_decoder  # noqa: E402
from magnitude.runner.quant_eval import kernel_description  # noqa: E402

from .test_paged_decoder import BLOCK, SEQS, _runner, _step  # noqa: E402
from .test_lowbit import avx2, kernel, native, portable  # noqa: E402,F401  (fixtures)
from .tiny_models import build_tiny_model, tiny_config  # noqa: E402

pytestmark = pytest.mark.model

# Decodes only: contexts 5, 40 (scattered blocks), 150 (11 scattered blocks, past any 8-token
# window) and 0 (a one-token prompt is a decode-shaped row too).
DECODES = [([0], 5, 1), ([1, 2, 4], 40, 1), ([10, 3, 12, 5, 14, 7, 16, 6, 18, 11, 22], 150, 1), ([20], 0, 1)]
# Relative difference from the lean forward: fp32 sums in another order through 2 layers,
# measured on AVX2 at most 1.6e-6 on the tiny models (bound ~6x that); SmolLM2's 30 layers 7.7e-6
# (test_the_real_models_decode_step, its own bound).
TINY_TOLERANCE = 1e-5
# w4a8 fused against its lean forward: the same int8 products; the fp32 sums elsewhere (norms,
# attention) differ in order, and a value moved across an int8 rounding boundary moves its
# group's product by a quantization step. Measured on AVX2: 3e-7 to 6e-7 on the tiny models (no
# crossing there); the lean forward itself moved by 2.2e-3 when its norm weights were scaled by
# (1 + 2^-22) (mistral-sliding, head size 64), which another CPU's sums could do. fp32 activations
# in the fused step instead are 4e-2 away (test_w4a8_fused_in_fp32_would_fail).
W4A8_TOLERANCE = 1e-2
# Over a float16 pool (kvCache.dtype) both forwards round the new K/V to halves, and a value whose
# fp32 sums differ in the last bit can land on the next half. Measured on AVX2 (tiny models, the
# parametrizations below): hidden states up to 6.5e-6 apart, caches up to 6e-6 (single elements a
# half's ulp apart), bound about 15x that.
FP16_POOL_TOLERANCE = 1e-4


def _native_or_skip() -> lowbit.LowbitKernels:
    k = lowbit.kernels()
    if k is None:
        pytest.skip(f"no native build here: {lowbit.describe()}")
    return k


def _prefill(runner, seqs, gen):
    lean = _lean(runner)
    with torch.inference_mode():
        lean(*_step(runner, seqs, False, gen))


def _lean(runner):
    inner = runner.model.model
    family = lean_family(inner)
    return lambda ids, pos, batch: lean_forward(inner, family, ids, pos, batch)


def _pool(runner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A copy of the KV pool, [layers] of (k, v)."""
    return [(k.clone(), v.clone()) for k, v in zip(runner.kv.k_layers, runner.kv.v_layers)]


def _restore(runner, copy) -> None:
    for (k, v), (k0, v0) in zip(zip(runner.kv.k_layers, runner.kv.v_layers), copy):
        k.copy_(k0)
        v.copy_(v0)


def _both(runner, seqs, seed=0):
    """(fused, lean) hidden states of the same decode step from the same cache, and the caches each
    left, [layers] of (k, v)."""
    inner = runner.model.model
    fused = paged_decoder(inner)
    gen = torch.Generator().manual_seed(seed)
    _prefill(runner, seqs, gen)
    before = _pool(runner)
    step = _step(runner, seqs, True, gen)
    with torch.inference_mode():
        want = _lean(runner)(*step).clone()
        lean_cache = _pool(runner)
        _restore(runner, before)
        got = fused(*step).clone()
    return got, want, _pool(runner), lean_cache


def _marked_mixed_step(runner):
    """A mixed step (two decodes, a 23-token chunk, a 9-token prompt: SEQS) from a prefilled cache, its
    chunk and prompt rows marked as the runner marks prompt rows, through the fused forward without
    marks (plain) and with them (marked), and the lean forward with them, each from the same cache:
    (plain, marked, lean, the marks as a bool tensor, the pool before the step, (ids, pos, batch))."""
    import numpy as np

    fused = paged_decoder(runner.model.model)
    gen = torch.Generator().manual_seed(1)
    _prefill(runner, SEQS, gen)
    snapshot = _pool(runner)
    step = _step(runner, SEQS, True, gen)
    marks = np.zeros(step[0].shape[-1], dtype=np.uint8)
    marks[2:] = 1  # rows 0, 1: the two decodes; then the chunk and the prompt
    with torch.inference_mode():
        plain = fused(*step).clone()
        _restore(runner, snapshot)
        with lowbit.prompt_rows(marks):
            marked = fused(*step).clone()
            _restore(runner, snapshot)
            lean = _lean(runner)(*step).clone()
        _restore(runner, snapshot)
    return plain, marked, lean, torch.from_numpy(marks.astype(bool)), snapshot, step


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _close_caches(fused_cache, lean_cache, tolerance):
    for (fk, fv), (lk, lv) in zip(fused_cache, lean_cache):
        assert _rel(fk, lk) < tolerance and _rel(fv, lv) < tolerance


def _tiny(arch: str, path, head_dim: int | None = None):
    """A tiny model; `head_dim` 64 or 128 takes the attention the C code specialises for those sizes
    (the tiny default, 16, takes its generic loop)."""
    config = tiny_config(arch)
    if head_dim:
        config.head_dim = head_dim
    return build_tiny_model(arch, path, config=config)


@pytest.mark.parametrize("arch,head_dim,quantization", [
    ("llama", None, "w4a16"), ("mistral-sliding", None, "w4a16"), ("qwen2", None, "w4a16"),
    ("qwen2-sliding", None, "w4a16"), ("llama", 64, "w4a16"), ("mistral-sliding", 64, "w4a16"),
    ("qwen2-sliding", 128, "w4a16"),
    # w4a8: the same int8 products as its lean forward (each linear's own call); the fp32 sums
    # elsewhere (norms, attention) can move an activation across an int8 rounding boundary, so
    # its bound is W4A8_TOLERANCE
    ("llama", None, "w4a8"), ("mistral-sliding", 64, "w4a8"), ("qwen2-sliding", 128, "w4a8")])
def test_a_decode_step_matches_the_lean_forward(arch, head_dim, quantization, tmp_path):
    _native_or_skip()
    runner = _runner(_tiny(arch, tmp_path / arch, head_dim), quantization=quantization)
    got, want, fused_cache, lean_cache = _both(runner, DECODES)
    print(f"\n{arch} head_dim {head_dim or 16} {quantization} fused vs lean: {_rel(got, want):.1e} "
          f"on {kernel_description(quantization)}")
    tolerance = W4A8_TOLERANCE if quantization == "w4a8" else TINY_TOLERANCE
    # > 0: the fused step ran (its sums are not the lean forward's), not the lean forward twice
    assert got.shape == want.shape and 0 < _rel(got, want) < tolerance
    _close_caches(fused_cache, lean_cache, tolerance)


@pytest.mark.parametrize("arch,head_dim", [("llama", None), ("llama", 64), ("mistral-sliding", 64),
                                           ("qwen2-sliding", 128)])
def test_a_decode_step_over_a_float16_pool_matches_the_lean_forward(arch, head_dim, tmp_path):
    """kvCache.dtype float16: the C step reads the halves the lean forward's prefill wrote (its vector
    attention at head sizes 64 and 128, the generic loop at 16) and writes the step's own."""
    _native_or_skip()
    runner = _runner(_tiny(arch, tmp_path / arch, head_dim), quantization="w4a16", kv_cache_dtype="float16")
    assert runner.kv.k_layers[0].dtype == torch.float16
    got, want, fused_cache, lean_cache = _both(runner, DECODES)
    print(f"\n{arch} head_dim {head_dim or 16} float16 pool, fused vs lean: {_rel(got, want):.1e} "
          f"on {kernel_description('w4a16')}")
    assert got.shape == want.shape and 0 < _rel(got, want) < FP16_POOL_TOLERANCE
    _close_caches(fused_cache, lean_cache, FP16_POOL_TOLERANCE)


# A bf16 model's fused step against its fp32 copy: hidden states are returned in bf16 (for the
# bf16 LM head), so they are compared after rounding the reference the same way, and a value whose
# fp32 sums differ in the last bit can land a bf16 step away. Measured on AMX (AVX-512 and AVX2
# builds): 0 to 1.9e-4 (the Llama with every bias), where the bf16 forward is 1.1e-2 to 6.3e-2 away.
BF16_ROUNDED_TOLERANCE = 1e-3


def _bf16_against_fp32(inner, reference, runner, seqs, seed=0):
    """(fused bf16, lean fp32 copy, lean bf16) hidden states of one decode step from the same cache
    (the copy's prefill), and the caches the fused step and the copy's step left."""
    gen = torch.Generator().manual_seed(seed)
    ref = lambda *a: lean_forward(reference, lean_family(reference), *a)  # noqa: E731
    with torch.inference_mode():
        ref(*_step(runner, seqs, False, gen))
        before = _pool(runner)
        step = _step(runner, seqs, True, gen)
        want = ref(*step).clone()
        ref_cache = _pool(runner)
        _restore(runner, before)
        bf16 = lean_forward(inner, lean_family(inner), *step).clone()
        _restore(runner, before)
        got = paged_decoder(inner)(*step).clone()
    return got, want, bf16, _pool(runner), ref_cache


@pytest.mark.parametrize("arch,head_dim", [("llama", None), ("qwen2", None), ("mistral-sliding", 64),
                                           ("qwen2-sliding", 128)])
def test_a_bf16_models_decode_step_is_its_weights_in_fp32(arch, head_dim, tmp_path):
    _native_or_skip()
    runner = _runner(_tiny(arch, tmp_path / arch, head_dim), dtype="bfloat16")
    inner = runner.model.model
    assert fused_decoder(inner, lean_family(inner).window) is not None
    reference = copy.deepcopy(inner).float()  # the same bf16 weights, run in fp32
    got, want, bf16, fused_cache, ref_cache = _bf16_against_fp32(inner, reference, runner, DECODES)
    print(f"\n{arch} head_dim {head_dim or 16} bf16 fused vs its fp32 copy: {_rel(got, want.bfloat16()):.1e}, "
          f"the bf16 forward {_rel(bf16, want):.1e}, on {lowbit.describe(bf16_products=False)}")
    assert got.dtype == torch.bfloat16 and _rel(got, want.bfloat16()) < BF16_ROUNDED_TOLERANCE
    assert _rel(bf16, want) > 10 * BF16_ROUNDED_TOLERANCE  # what rounding activations to bf16 does
    _close_caches(fused_cache, ref_cache, TINY_TOLERANCE)  # the K/V it wrote, in fp32


def _random_biases(inner, drop_k_bias: bool) -> None:
    """Non-zero biases wherever the model has them (transformers initialises them to 0), and with
    `drop_k_bias` none on k_proj, so the stacked q/k/v bias fills a member's share with zeros."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in inner.layers:
            if drop_k_bias:
                layer.self_attn.k_proj.bias = None
            for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                      layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                if m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)


@pytest.mark.parametrize("arch,chunk", [("qwen2", 10), ("llama-biases", 11)])
def test_a_bf16_models_step_on_every_build_with_biases_and_odd_widths(kernel, arch, chunk, tmp_path, monkeypatch):
    """The bf16 products on the native and AVX2 builds (the portable one is not used for them),
    over widths past their vectors (hidden 76, intermediate 101: a tail on both widths, an odd
    channel), 12 decodes and a 10- or 11-token chunk (passes of 4 rows ending in 2 or 3), non-zero
    biases (Qwen2's q/v with none on k; a Llama's on every projection), against the fp32 copy."""
    monkeypatch.setattr(lowbit, "_loaded", kernel)
    config = tiny_config("llama" if arch == "llama-biases" else arch)
    if arch == "llama-biases":
        config.attention_bias = config.mlp_bias = True
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 76, 4, 2
    config.head_dim, config.intermediate_size = 18, 101
    runner = _runner(build_tiny_model(config.model_type, tmp_path / arch, config=config), dtype="bfloat16")
    inner = runner.model.model
    _random_biases(inner, drop_k_bias=arch == "qwen2")
    fused = fused_decoder(inner, lean_family(inner).window)
    if kernel.isa == "generic":
        assert fused is None  # the portable build has no bf16 products
        return
    seqs = [([b], 3 + b, 1) for b in range(12)] + [([20, 21], 4, chunk)]
    assert fused.choose(_step(runner, seqs, True, torch.Generator())[2])
    got, want, bf16, fused_cache, ref_cache = _bf16_against_fp32(inner, copy.deepcopy(inner).float(), runner, seqs)
    print(f"\n{kernel.name}: {arch} bf16 fused vs its fp32 copy {_rel(got, want.bfloat16()):.1e}, the bf16 forward "
          f"{_rel(bf16, want):.1e}")
    assert got.shape[0] == 12 + chunk and _rel(got, want.bfloat16()) < BF16_ROUNDED_TOLERANCE < _rel(bf16, want)
    _close_caches(fused_cache, ref_cache, TINY_TOLERANCE)


def test_a_pool_read_in_the_wrong_dtype_would_fail(tmp_path, monkeypatch):
    """The comparisons can fail: a step that reads an fp32 pool as halves (a dtype flag wrong on the
    way to C; the other way round would read past the pool) is far outside FP16_POOL_TOLERANCE."""
    _native_or_skip()
    from magnitude.runner import fused_decode

    class _WrongFlag(fused_decode._Dims):
        def __init__(self, **kw):
            super().__init__(**{**kw, "kv_f16": 1})

    runner = _runner(_tiny("llama", tmp_path / "l", 64), quantization="w4a16", kv_cache_dtype="float32")
    monkeypatch.setattr(fused_decode, "_Dims", _WrongFlag)
    got, want, _f, _l = _both(runner, DECODES)
    print(f"\nfp32 pool read as halves: {_rel(got, want):.1e}")
    assert not _rel(got, want) < FP16_POOL_TOLERANCE  # NaN counts as failing too


def test_w4a8_fused_in_fp32_would_fail(tmp_path, monkeypatch):
    """The w4a8 comparison can fail: a fused step that multiplied fp32 activations (the flag lost on
    the way to C) is outside W4A8_TOLERANCE of the int8 products."""
    _native_or_skip()
    from magnitude.runner import fused_decode

    runner = _runner(_tiny("llama", tmp_path / "l", 64), quantization="w4a8")
    real = fused_decode._native_int4
    monkeypatch.setattr(fused_decode, "_native_int4",
                        lambda module, kernel: None if (op := real(module, kernel)) is None
                        else dataclasses.replace(op, activations="fp32"))
    got, want, _f, _l = _both(runner, DECODES)
    print(f"\nw4a8 lean vs a fused step in fp32: {_rel(got, want):.1e}")
    assert _rel(got, want) > W4A8_TOLERANCE


def test_a_dropped_window_would_fail(tmp_path, monkeypatch):
    """The windowed comparison can fail: handing the C step no window changes the output."""
    _native_or_skip()
    from magnitude.runner import fused_decode

    runner = _runner(build_tiny_model("mistral-sliding", tmp_path / "m"), quantization="w4a16")
    real = fused_decode.fused_decoder
    monkeypatch.setattr("magnitude.runner.paged_decoder.fused_decoder", lambda inner, window: real(inner, lambda a: None))
    got, want, _f, _l = _both(runner, DECODES)
    assert _rel(got, want) > 1e-3


@pytest.mark.parametrize("head_dim,dtype,quantization", [(None, "float32", "w4a16"), (64, "float32", "w4a16"),
                                                         (64, "float32", "w4a8"), (64, "bfloat16", "none")])
def test_a_rows_result_is_the_same_alone_batched_and_on_one_thread(head_dim, dtype, quantization, tmp_path):
    _native_or_skip()
    runner = _runner(_tiny("qwen2-sliding", tmp_path / "q", head_dim), dtype=dtype, quantization=quantization)
    assert runner.fused_steps
    fused = paged_decoder(runner.model.model)
    gen = torch.Generator().manual_seed(5)
    _prefill(runner, DECODES, gen)
    snapshot = _pool(runner)

    ids, pos, batch = _step(runner, DECODES, True, gen)
    with torch.inference_mode():
        together = fused(ids, pos, batch).clone()
        for i, seq in enumerate(DECODES):
            _restore(runner, snapshot)
            alone_step = _step(runner, [seq], True, torch.Generator())
            alone = fused(ids[:, i : i + 1], pos[:, i : i + 1], alone_step[2])
            assert torch.equal(alone[0], together[i]), i
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                _restore(runner, snapshot)
                assert torch.equal(fused(ids, pos, batch), together)
        finally:
            torch.set_num_threads(threads)


def test_a_step_with_short_chunks_runs_fused_and_matches(tmp_path):
    """The mixed step of the lean forward's tests (decodes, a 23-token chunk at position 150 over
    scattered blocks, a fresh 9-token prompt) qualifies: its chunks attend to few keys."""
    _native_or_skip()
    runner = _runner(build_tiny_model("qwen2-sliding", tmp_path / "q"), quantization="w4a16")
    assert runs_fused(_step(runner, SEQS, True, torch.Generator())[2])
    got, want, fused_cache, lean_cache = _both(runner, SEQS, seed=1)
    assert _rel(got, want) < TINY_TOLERANCE
    _close_caches(fused_cache, lean_cache, TINY_TOLERANCE)


@pytest.mark.parametrize("arch,head_dim,kv_cache_dtype", [
    ("llama", None, "float32"), ("mistral-sliding", 64, "float32"), ("qwen2", 128, "float32"),
    ("mistral-sliding", 64, "float16"), ("qwen2", 128, "float16")])
def test_a_chunk_rows_result_is_its_result_as_a_lone_row(arch, head_dim, kv_cache_dtype, tmp_path):
    """The chunk's rows are attended together (a pool block read once for all of them, in runs of
    up to 16 rows; over a float16 pool from a copy of each block's keys and values widened to
    fp32); each row's result must still be what it is alone, read from the pool itself: the same
    step's row, bit for bit, recomputed as a one-row step over the cache the chunk step left. Rows checked:
    the first, one inside and the last of the first run, the first of the second run, the last; with
    an 8-token window the rows' key ranges differ."""
    _native_or_skip()
    runner = _runner(_tiny(arch, tmp_path / arch, head_dim), quantization="w4a16", kv_cache_dtype=kv_cache_dtype)
    inner = runner.model.model
    assert fused_decoder(inner, lean_family(inner).window) is not None
    fused = paged_decoder(inner)
    chunk_table = [1, 2, 3, 4, 5]
    seqs = [([0], 5, 1), (chunk_table, 10, 20)]  # a decode, and a 20-token chunk at positions 10..29
    gen = torch.Generator().manual_seed(3)
    _prefill(runner, seqs, gen)
    ids, pos, batch = _step(runner, seqs, True, gen)
    assert runs_fused(batch)
    with torch.inference_mode():
        together = fused(ids, pos, batch).clone()
        want = _lean(runner)(ids, pos, batch)  # rewrites the same K/V (to fp32 rounding)
        assert _rel(together, want) < (TINY_TOLERANCE if kv_cache_dtype == "float32" else FP16_POOL_TOLERANCE)
        fused(ids, pos, batch)  # the cache as the fused step leaves it
        for row in (1, 8, 16, 17, 20):
            position = int(pos[0, row])
            lone = build_paged_batch([SeqSlice(0, 1, position, chunk_table)], BLOCK, runner.kv.k_layers,
                                     runner.kv.v_layers, runner.device)
            alone = fused(ids[:, row : row + 1], pos[:, row : row + 1], lone)
            assert torch.equal(alone[0], together[row]), row


def test_a_step_with_a_long_chunk_runs_the_lean_forward_bit_for_bit(tmp_path):
    # w4a8: its 64-row bound fits the 32-block test pool (w4a16's 512 rows would not); the fused
    # step declines either's step alike
    _native_or_skip()
    runner = _runner(build_tiny_model("llama", tmp_path / "l"), quantization="w4a8")
    inner = runner.model.model
    seqs = [([0], 5, 1), ([1, 2, 3, 4, 5, 6], 10, FUSED_MAX_CHUNK_ROWS + 1)]  # one chunk row over w4a8's limit
    gen = torch.Generator().manual_seed(1)
    _prefill(runner, seqs, gen)
    step = _step(runner, seqs, True, gen)
    assert not fused_decoder(inner, lean_family(inner).window).choose(step[2])
    snapshot = _pool(runner)
    with torch.inference_mode():
        want = _lean(runner)(*step).clone()
        _restore(runner, snapshot)
        assert torch.equal(paged_decoder(inner)(*step), want)


@pytest.mark.parametrize("kv_cache_dtype,tolerance", [("float32", TINY_TOLERANCE), ("float16", FP16_POOL_TOLERANCE)])
def test_the_portable_build_runs_a_step_of_more_than_eight_rows(kv_cache_dtype, tolerance, tmp_path, monkeypatch):
    """The C without AVX2 (what an ARM or older x86 CPU builds) over 20 decodes: its products take
    rows in passes of 8, so 20 rows cross a pass boundary; over either pool dtype (a float16 one
    through its scalar conversions). A step with a chunk runs the lean forward there
    (FUSED_BOUNDS_PORTABLE), however short the chunk."""
    from .test_lowbit import PORTABLE_FLAGS

    portable = lowbit.load(lowbit.build(tmp_path / "portable", flags=PORTABLE_FLAGS))
    assert portable.isa == "generic"
    monkeypatch.setattr(lowbit, "_loaded", portable)
    runner = _runner(build_tiny_model("qwen2", tmp_path / "q"), quantization="w4a16", kv_cache_dtype=kv_cache_dtype)
    inner = runner.model.model
    choose = fused_decoder(inner, lean_family(inner).window).choose
    with_chunk = [([b], 3 + b, 1) for b in range(12)] + [([20, 21], 4, 1), ([22], 0, 2)]
    assert not choose(_step(runner, with_chunk, True, torch.Generator())[2])
    seqs = [([b], 3 + b % 12, 1) for b in range(20)]
    assert choose(_step(runner, seqs, True, torch.Generator())[2])
    got, want, fused_cache, lean_cache = _both(runner, seqs, seed=3)
    print(f"\nportable build, {kv_cache_dtype} pool, fused vs lean: {_rel(got, want):.1e}")
    assert got.shape[0] == 20 and 0 < _rel(got, want) < tolerance
    _close_caches(fused_cache, lean_cache, tolerance)


def test_a_step_over_another_pool_reads_and_writes_that_pool(tmp_path):
    """The fused forward points its layer table at a pool once and keeps it while steps come over
    the same tensors; a step over other tensors points it again. Here the first pool is zeroed
    after its step: a table still pointing at it would attend to zeros (and write there)."""
    _native_or_skip()
    runner = _runner(_tiny("llama", tmp_path / "l", 64), quantization="w4a16", kv_cache_dtype="float16")
    fused = paged_decoder(runner.model.model)
    gen = torch.Generator().manual_seed(3)
    _prefill(runner, DECODES, gen)
    before = _pool(runner)
    ids, pos, batch = _step(runner, DECODES, True, gen)
    with torch.inference_mode():
        first = fused(ids, pos, batch).clone()
        assert batch._groups is None  # a fused step builds no SDPA groups
        written = _pool(runner)
        other = [(k.clone(), v.clone()) for k, v in before]
        for k, v in zip(runner.kv.k_layers, runner.kv.v_layers):
            k.zero_()
            v.zero_()
        moved = dataclasses.replace(batch, k_layers=[k for k, _ in other], v_layers=[v for _, v in other])
        again = fused(ids, pos, moved)
    assert torch.equal(again, first)
    for (k, v), (wk, wv) in zip(other, written):  # the step's K/V went into the pool it was given
        assert torch.equal(k, wk) and torch.equal(v, wv)
    assert all(not k.any() and not v.any() for k, v in zip(runner.kv.k_layers, runner.kv.v_layers))


def test_a_block_id_outside_the_pool_is_refused_before_the_native_call(tmp_path):
    _native_or_skip()
    runner = _runner(build_tiny_model("llama", tmp_path / "l"), quantization="w4a16")
    ids, pos, batch = _step(runner, DECODES, True, torch.Generator())
    batch.row_tables[1, 0] = runner.kv.k_layers[0].shape[0] // BLOCK  # one past the last block
    with pytest.raises(ValueError, match="outside the pool"):
        paged_decoder(runner.model.model)(ids, pos, batch)


def _shaped_batch(runner, seqs):
    """A paged batch of `seqs`, (tokens cached, tokens this step) each; block tables are not read."""
    slices, offset = [], 0
    for cached, n in seqs:
        slices.append(SeqSlice(offset, n, cached, list(range(-(-(cached + n) // BLOCK)))))
        offset += n
    return build_paged_batch(slices, BLOCK, runner.kv.k_layers, runner.kv.v_layers, runner.device)


# w4a16's chunk rows per build of the kernels (fused_decode.py has the measurements)
W4A16_CHUNK_ROWS = {"avx512": FUSED_MAX_CHUNK_ROWS_W4A16, "avx2": FUSED_MAX_CHUNK_ROWS_W4A16_AVX2, "generic": 0}


def test_w4a16_chunk_rows_by_build(kernel, tmp_path, monkeypatch):
    """Under w4a16 a step runs fused with up to FUSED_MAX_CHUNK_ROWS_W4A16 chunk rows on the AVX-512
    build, FUSED_MAX_CHUNK_ROWS_W4A16_AVX2 on the AVX2 one and none on the portable one, decodes in
    any number on each."""
    monkeypatch.setattr(lowbit, "_loaded", kernel)
    runner = _runner(build_tiny_model("llama", tmp_path / "w"), quantization="w4a16")
    inner = runner.model.model
    choose = fused_decoder(inner, lean_family(inner).window).choose
    rows = W4A16_CHUNK_ROWS[kernel.isa]
    assert choose(_shaped_batch(runner, [(100, 1)] * 96))
    assert choose(_shaped_batch(runner, [(100, 1)] * 8 + ([(0, rows)] if rows else [])))
    # (a one-token chunk is a decode row to the step: it groups with them)
    assert not choose(_shaped_batch(runner, [(100, 1)] + [(0, max(rows + 1, 2))]))


def test_which_steps_run_fused(tmp_path):
    """Decodes at any context and in any number; chunks while the step has at most
    FUSED_MAX_CHUNK_ROWS of their rows and they attend to FUSED_MAX_CHUNK_KEYS keys or fewer together
    (runs_fused's defaults, w4a8's), under w4a16 up to its own larger bounds."""
    runner = _runner(build_tiny_model("llama", tmp_path / "l"))
    batch = functools.partial(_shaped_batch, runner)

    assert runs_fused(batch([(3000, 1)] * 8))  # decodes only, long contexts
    assert runs_fused(batch([(100, 1)] * 96))  # more decode rows than a chunk may have
    assert runs_fused(batch([(100, 1)] * 40 + [(0, FUSED_MAX_CHUNK_ROWS)]))
    assert not runs_fused(batch([(100, 1)] + [(0, FUSED_MAX_CHUNK_ROWS + 1)]))  # one chunk row too many
    assert not runs_fused(batch([(0, FUSED_MAX_CHUNK_ROWS // 2), (0, FUSED_MAX_CHUNK_ROWS // 2 + 1)]))  # chunks count together
    # 16 rows at positions s..s+15 attend to 16 * s + 136 keys together.
    deep = (FUSED_MAX_CHUNK_KEYS - 136) // 16
    assert runs_fused(batch([(deep, 16), (5000, 1)]))
    assert not runs_fused(batch([(deep + 1, 16), (5, 1)]))
    assert not runs_fused(batch([(deep // 2, 16), (deep // 2, 16)]))  # two chunks count together
    # a w4a16 model's: chunks up to its build's rows and FUSED_MAX_CHUNK_KEYS_W4A16 keys (its products
    # blocked for many rows, lowbit_kernels.c; test_w4a16_chunk_rows_by_build); the bounds above are w4a8's
    built = _native_or_skip()
    w4a16 = _runner(build_tiny_model("llama", tmp_path / "w"), quantization="w4a16")
    choose = fused_decoder(w4a16.model.model, lean_family(w4a16.model.model).window).choose
    assert FUSED_MAX_CHUNK_ROWS_W4A16_AVX2 > FUSED_MAX_CHUNK_ROWS and FUSED_MAX_CHUNK_KEYS_W4A16 > FUSED_MAX_CHUNK_KEYS
    assert choose(batch([(100, 1)] * 8 + [(0, W4A16_CHUNK_ROWS[built.isa])]))
    assert not choose(batch([(100, 1)] + [(0, W4A16_CHUNK_ROWS[built.isa] + 1)]))
    deep16 = (FUSED_MAX_CHUNK_KEYS_W4A16 - 136) // 16
    assert choose(batch([(deep16, 16), (5000, 1)])) and not choose(batch([(deep16 + 1, 16)]))
    assert runs_fused(batch([(deep16, 16)]), **FUSED_BOUNDS_W4A16)
    # a bf16 model's: its chunks up to FUSED_MAX_CHUNK_ROWS_DENSE_BF16 rows, decodes in any number
    bf16 = _runner(build_tiny_model("llama", tmp_path / "b"), dtype="bfloat16")
    _native_or_skip()
    choose = fused_decoder(bf16.model.model, lean_family(bf16.model.model).window).choose
    assert choose(batch([(100, 1)] * 96 + [(0, FUSED_MAX_CHUNK_ROWS_DENSE_BF16)]))
    assert not choose(batch([(100, 1)] + [(0, FUSED_MAX_CHUNK_ROWS_DENSE_BF16 + 1)]))


@pytest.mark.parametrize("dtype,quantization,kernel", [("float32", "none", ""), ("float32", "w8a16", ""),
                                                       ("bfloat16", "w4a16", ""), ("float32", "w4a16", "torch"),
                                                       ("bfloat16", "none", "torch"), ("bfloat16", "w8a16", "")])
def test_models_it_does_not_run_keep_the_lean_forward(tmp_path, monkeypatch, dtype, quantization, kernel):
    if kernel:
        monkeypatch.setenv(lowbit.KERNEL_ENV, kernel)
    runner = _runner(build_tiny_model("llama", tmp_path / "l"), dtype=dtype, quantization=quantization)
    inner = runner.model.model
    assert fused_decoder(inner, lean_family(inner).window) is None


def test_a_model_to_be_quantized_runs_unfused_until_it_is(tmp_path, monkeypatch):
    """A bf16 model loaded for w8a16 is the quantization evaluation's reference until it is
    quantized: its decoder must call its modules (their hooks give the checkpoint's pages back), so
    the runner builds it without the fused step; a bf16 model served as loaded runs fused."""
    _native_or_skip()
    from magnitude.runner import runner as runner_module

    calls = []

    def recording(inner, fused=True):
        calls.append(fused)
        return paged_decoder(inner, fused=fused)

    monkeypatch.setattr(runner_module, "paged_decoder", recording)
    path = build_tiny_model("llama", tmp_path / "l")
    quantized = _runner(path, dtype="bfloat16", quantization="w8a16")
    assert calls == [False, True] and not quantized.fused_steps  # w8a16 linears: nothing to fuse
    calls.clear()
    assert _runner(path, dtype="bfloat16").fused_steps and calls == [True]
    assert paged_decoder(quantized.model.model, fused=False).__name__ == "<lambda>"  # the lean forward


def test_w4a8_is_refused_by_name_where_the_kernels_are_not_in_use(tmp_path, monkeypatch):
    """w4a8 has no torch fallback: with torch's kernels chosen the load fails naming it, before
    any linear is replaced."""
    from magnitude.runner.quantize import QuantizationError

    monkeypatch.setenv(lowbit.KERNEL_ENV, "torch")
    with pytest.raises(QuantizationError, match="w4a8 runs on Magnitude's low-bit kernels only.*use w4a16"):
        _runner(build_tiny_model("llama", tmp_path / "l"), quantization="w4a8")


def test_the_rope_table_gives_the_rotary_modules_rows(tmp_path, monkeypatch):
    """The fused step's cos/sin come from a table built by the model's own rotary module and
    indexed by position: the same bits as calling the module for those positions, past the first
    1,024 rows too (the table grows); a RoPE type that rescales with the length calls the module."""
    from magnitude.runner.fused_decode import _RopeTable

    runner = _runner(build_tiny_model("llama", tmp_path / "l"))
    rotary = runner.model.model.rotary_emb
    table = _RopeTable(rotary)
    assert table.static
    h = torch.randn(1, 5, runner.model.config.hidden_size)
    for positions in ([[0, 7, 100, 101, 1023]], [[5, 1024, 2047, 2500, 3]]):
        pos = torch.tensor(positions)
        cos, sin = table.rows(h, pos)
        want_cos, want_sin = rotary(h, position_ids=pos)
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    assert table.cos.shape[0] >= 2501
    monkeypatch.setattr(rotary, "rope_type", "dynamic")
    assert not _RopeTable(rotary).static


def test_an_unquantized_fp32_model_never_builds_the_kernels(tmp_path, monkeypatch):
    """paged_decoder runs for every model at load; only low-bit and bf16 weights need the C build."""
    def no_build(*_a, **_k):
        raise AssertionError("the kernels were asked for")

    monkeypatch.setattr(lowbit, "kernels", no_build)
    runner = _runner(build_tiny_model("llama", tmp_path / "l"))
    assert paged_decoder(runner.model.model).__name__ == "<lambda>"  # the lean forward


def test_the_real_models_decode_step(runner_w4a16):
    """SmolLM2 w4a16: 30 layers, 9 query heads over 3 KV heads."""
    seqs = [([60 + b for b in table], cached, n) for table, cached, n in DECODES]
    got, want, fused_cache, lean_cache = _both(runner_w4a16, seqs, seed=2)
    print(f"\nSmolLM2 w4a16 fused vs lean: {_rel(got, want):.1e} on {kernel_description('w4a16')}")
    assert _rel(got, want) < 1e-4
    _close_caches(fused_cache, lean_cache, 1e-4)


def test_the_real_models_w4a8_decode_step(runner_w4a16):
    """SmolLM2 w4a8 (the w4a16 runner's model with its products switched to int8 activations, the
    same codes), fused against lean. Over 30 layers int8 rounding amplifies fp32 rounding: a value
    that crosses a rounding boundary moves its group's product by a quantization step, and that
    spreads. So the yardstick is the lean forward's own sensitivity: the same step with every norm
    weight scaled by (1 + 2^-22), about one fp32 rounding, moved it by 6.5e-3 to 1.1e-2 here, fused
    vs lean by 6.2e-3, w4a8 vs w4a16 1.3e-2 (AVX2). The fused step must stay within 3x the
    sensitivity; test_w4a8_fused_in_fp32_would_fail is the finer check, on a model too shallow to
    amplify."""
    from magnitude.runner.quantize import Int4WeightOnlyLinear

    runner = runner_w4a16
    linears = [m for m in runner.model.modules() if isinstance(m, Int4WeightOnlyLinear)]
    norms = [layer.input_layernorm.weight for layer in runner.model.model.layers]
    seqs = [([60 + b for b in table], cached, n) for table, cached, n in DECODES]
    _a16, a16_lean, _f, _l = _both(runner, seqs, seed=2)
    saved = [w.clone() for w in norms]
    try:
        for m in linears:
            m.activations = "int8"
        got, want, _f, _l = _both(runner, seqs, seed=2)
        with torch.inference_mode():
            for w in norms:
                w.mul_(1 + 2**-22)
        _g, nudged, _f, _l = _both(runner, seqs, seed=2)
    finally:
        for m in linears:
            m.activations = "fp32"
        with torch.inference_mode():
            for w, w0 in zip(norms, saved):
                w.copy_(w0)
    sensitivity = _rel(nudged, want)
    print(f"\nSmolLM2 w4a8 fused vs lean: {_rel(got, want):.1e}; lean vs lean nudged by 2^-22: {sensitivity:.1e}; "
          f"w4a8 vs w4a16 (lean): {_rel(want, a16_lean):.1e}; on {kernel_description('w4a8')}")
    assert 0 < sensitivity < _rel(want, a16_lean)
    assert 0 < _rel(got, want) < 3 * sensitivity  # > 0: the fused step ran


@pytest.fixture(scope="module")
def runner_w4a16():
    _native_or_skip()
    from magnitude.runner import ModelRunner

    from .conftest import MODEL

    return ModelRunner(MODEL, device="cpu", dtype="float32", block_size=BLOCK, num_blocks=128, seed=0,
                       quantization="w4a16", evaluate_quantization=False, warmup=False)


def test_the_real_models_bf16_decode_step(runner_w4a16):
    """SmolLM2 in bf16 (the fp32 reference's weights rounded to bf16; the w4a16 runner's pool), fused,
    against the same bf16 weights run in fp32 by the lean forward: 30 layers of fp32 sums in another
    order."""
    from magnitude.runner import ModelRunner

    from .conftest import MODEL

    runner = ModelRunner(MODEL, device="cpu", dtype="bfloat16", block_size=BLOCK, num_blocks=128, seed=0,
                         evaluate_quantization=False, warmup=False)
    inner = runner.model.model
    reference = copy.deepcopy(inner).float()
    seqs = [([60 + b for b in table], cached, n) for table, cached, n in DECODES]
    got, want, bf16, fused_cache, ref_cache = _bf16_against_fp32(inner, reference, runner, seqs, seed=3)
    print(f"\nSmolLM2 bf16 fused vs its fp32 copy: {_rel(got, want.bfloat16()):.1e}, the bf16 forward "
          f"{_rel(bf16, want):.1e}, on {lowbit.describe(bf16_products=False)}")
    assert _rel(got, want.bfloat16()) < BF16_ROUNDED_TOLERANCE < _rel(bf16, want)
    _close_caches(fused_cache, ref_cache, 1e-4)


def test_tied_embeddings_are_read_from_the_int8_heads_codes(tmp_path):
    """w4a16 on a model whose token embeddings are its LM head's weight: the head is int8 in groups
    of 32 and the embeddings are read from its codes (no fp32 [vocab, hidden] matrix left in the
    model), the fused step still runs, and transformers' own `generate` over the same modules
    gives the runner's greedy tokens."""
    _native_or_skip()
    from magnitude.runner.quantize import Int8GroupEmbedding, Int8GroupLinear

    config = tiny_config("llama")
    config.tie_word_embeddings = True
    runner = _runner(build_tiny_model("llama", tmp_path / "tied", config=config), quantization="w4a16")
    model = runner.model
    assert type(model.lm_head) is Int8GroupLinear and type(model.model.embed_tokens) is Int8GroupEmbedding
    assert model.model.embed_tokens.codes.data_ptr() == model.lm_head.qweight.data_ptr()
    vocab, hidden = config.vocab_size, config.hidden_size
    assert not [n for n, t in (*model.named_parameters(), *model.named_buffers())
                if t.dtype == torch.float32 and tuple(t.shape) == (vocab, hidden)]
    assert lean_family(model.model) is not None
    got, want, _f, _l = _both(runner, DECODES)
    assert 0 < _rel(got, want) < TINY_TOLERANCE  # the fused step ran, on the same embeddings
    prompts = [[5, 9, 44, 100, 7], [3, 3, 8]]
    ours = runner.greedy_tokens(prompts, 6)
    with torch.inference_mode():
        theirs = [model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=2,
                                 pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]
    assert ours == [t[: t.index(2) + 1] if 2 in t else t for t in theirs]
