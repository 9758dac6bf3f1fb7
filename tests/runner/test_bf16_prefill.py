"""w4a16-bf16prefill (runner/quantize.py, `int4_mixed_rows` in lowbit_kernels.c): the rows of a
prompt chunk are multiplied in bf16 (x and the 4-bit weights rounded to bf16, VDPBF16PS, fp32
sums; on AMX tiles where the CPU has them), every other row exactly as w4a16's. The kernel must compute that product and nothing else,
give a row the same bits whatever shares its batch, and leave unmarked rows bit for bit w4a16's;
the fused step and the lean forward must both apply it to the rows the runner marks, and only to
those; a build without AVX512-BF16 must refuse the method by name. The kernel tests need a CPU with
avx512_bf16 (AVX-512 BF16 or AMX) and are skipped elsewhere, saying so; each test prints the CPU
and the build it ran on."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from magnitude.runner import lowbit  # noqa: E402
from magnitude.runner.quant_eval import isa_description, kernel_description  # noqa: E402
from magnitude.runner.quantize import Int4WeightOnlyLinear, QuantizationError  # noqa: E402

from .test_fused_decode import TINY_TOLERANCE, _marked_mixed_step, _rel  # noqa: E402
from .test_lowbit import AVX2_FLAGS, _build_with, dequantized_int4, int4_weights  # noqa: E402
from .test_paged_decoder import _runner  # noqa: E402
from .tiny_models import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def bf16_kernel() -> lowbit.LowbitKernels:
    k = lowbit.kernels()
    if k is None or not k.bf16:
        pytest.skip(f"no bf16 products here (needs avx512_bf16): {lowbit.describe() if k is None else k.name} "
                    f"on {isa_description()}")
    print(f"\nlowbit kernels {k.name} (bf16 products) on {isa_description()}")
    return k


def bf16_rounded(t: torch.Tensor) -> torch.Tensor:
    return t.float().to(torch.bfloat16).double()


@pytest.mark.parametrize("m", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("k,n", [(32, 7), (96, 37), (576, 101)])
def test_marked_rows_are_the_bf16_product_and_the_others_w4a16s(bf16_kernel, m, k, n):
    """A marked row is x rounded to bf16 times the weights rounded to bf16, summed in fp32 (~1e-6
    from the exact product of the rounded operands; the fp32 product is ~1e-3 away, so rounding
    either operand otherwise would show); an unmarked row is w4a16's, bit for bit."""
    codes, packed, scales, mins = int4_weights(n, k, seed=m * 1000 + k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    marks = np.array([(r * 7 + m) % 3 != 0 for r in range(m)], dtype=np.uint8)
    if not marks.any():
        marks[0] = 1
    got = bf16_kernel.int4_bf16_matmul(x, packed, scales, mins, marks)
    exact = bf16_kernel.int4_matmul(x, packed, scales, mins)
    w = dequantized_int4(codes, scales, mins).float()
    want = bf16_rounded(x) @ bf16_rounded(w).t()
    on = torch.from_numpy(marks.astype(bool))
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert _rel(got[on], want[on]) < 1e-5, _rel(got[on], want[on])
    assert _rel(got[on], exact[on]) > 1e-4  # it did round
    assert torch.equal(got[~on], exact[~on])


def test_a_marked_rows_result_does_not_depend_on_its_batch_or_the_threads(bf16_kernel):
    """Alone, in a batch of 15 (passes of 8 rows, a short last one) with any other rows marked or
    not, and on one or two threads: the same bits."""
    codes, packed, scales, mins = int4_weights(200, 576, seed=3)
    x = torch.randn(15, 576)
    marks = np.ones(15, dtype=np.uint8)
    marks[[0, 6, 7]] = 0
    batched = bf16_kernel.int4_bf16_matmul(x, packed, scales, mins, marks)
    all_marked = bf16_kernel.int4_bf16_matmul(x, packed, scales, mins, np.ones(15, dtype=np.uint8))
    for r in range(15):
        row = x[r : r + 1].contiguous()
        if marks[r]:
            alone = bf16_kernel.int4_bf16_matmul(row, packed, scales, mins, np.ones(1, dtype=np.uint8))
            assert torch.equal(alone[0], batched[r]) and torch.equal(all_marked[r], batched[r]), r
        else:
            assert torch.equal(bf16_kernel.int4_matmul(row, packed, scales, mins)[0], batched[r]), r
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(bf16_kernel.int4_bf16_matmul(x, packed, scales, mins, marks), batched)
    finally:
        torch.set_num_threads(threads)


def test_amx_tiles_and_avx512_bf16_multiply_the_same_operands(bf16_kernel, monkeypatch):
    """On a CPU with AMX the marked rows run on its tiles (MAGNITUDE_LOWBIT_AMX, on by default);
    the AVX512-BF16 pass multiplies the same bf16 operands, so the two agree to the order of their
    fp32 sums: for 1 row (a padded tile), 17 (a second tile) and 70 (past a 64-row block), and for
    a channel count that leaves a short last block. Any other value than 0 or 1 is refused by name."""
    if not bf16_kernel.amx:
        pytest.skip(f"no AMX tiles here: {bf16_kernel.name} on {isa_description()}")
    _codes, packed, scales, mins = int4_weights(200, 576, seed=5)
    lib = bf16_kernel.lib
    for m in (1, 17, 70):
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        marks = np.ones(m, dtype=np.uint8)
        amx = bf16_kernel.int4_bf16_matmul(x, packed, scales, mins, marks)
        try:
            assert lib.magnitude_lowbit_set_amx(0) == 0
            avx512 = bf16_kernel.int4_bf16_matmul(x, packed, scales, mins, marks)
        finally:
            assert lib.magnitude_lowbit_set_amx(1) == 1
        assert _rel(amx, avx512) < 1e-5, (m, _rel(amx, avx512))
        assert m == 1 or not torch.equal(amx, avx512)  # other sums' order: the tiles did run
    monkeypatch.setenv(lowbit.AMX_ENV, "yes")
    with pytest.raises(lowbit.LowbitKernelError, match="MAGNITUDE_LOWBIT_AMX='yes': expected 0 or 1"):
        lowbit.load(bf16_kernel.path)
    with pytest.raises(lowbit.LowbitKernelError, match="MAGNITUDE_LOWBIT_AMX='yes'"):
        lowbit.kernels()  # refused, not taken for a failed build (which would fall back to torch's)
    monkeypatch.setenv(lowbit.AMX_ENV, "0")
    try:
        off = lowbit.load(bf16_kernel.path)
        assert not off.amx and off.name == bf16_kernel.name.removesuffix("-amx")
    finally:
        assert lib.magnitude_lowbit_set_amx(1) == 1


def test_only_the_method_that_runs_the_bf16_products_is_keyed_by_the_amx_switch(bf16_kernel, monkeypatch):
    """Records and step-cost tables are keyed by `kernel_description(method)`: flipping
    MAGNITUDE_LOWBIT_AMX gives w4a16-bf16prefill other keys (its prompt products change) and leaves
    w4a16's and w4a8's alone (theirs do not), so a flip does not re-measure them."""
    if not bf16_kernel.amx:
        pytest.skip(f"no AMX tiles here: {bf16_kernel.name} on {isa_description()}")
    monkeypatch.delenv(lowbit.KERNEL_ENV, raising=False)
    on = {m: kernel_description(m) for m in ("w4a16", "w4a8", "w4a16-bf16prefill")}
    assert "-amx build" in on["w4a16-bf16prefill"] and "-amx" not in on["w4a16"] + on["w4a8"]
    try:
        assert bf16_kernel.lib.magnitude_lowbit_set_amx(0) == 0
        off = {m: kernel_description(m) for m in on}
    finally:
        assert bf16_kernel.lib.magnitude_lowbit_set_amx(1) == 1
    assert off["w4a16"] == on["w4a16"] and off["w4a8"] == on["w4a8"]
    assert off["w4a16-bf16prefill"] != on["w4a16-bf16prefill"]


def test_the_linear_multiplies_the_marked_rows_of_the_step_in_bf16(bf16_kernel):
    """Int4WeightOnlyLinear("bf16prefill") takes the rows `lowbit.prompt_rows` marks for a product of
    that many rows; outside such a block, or for a product of another row count, it is w4a16."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(576, 96, bias=True)
    a16, bf = Int4WeightOnlyLinear(lin), Int4WeightOnlyLinear(lin, activations="bf16prefill")
    assert "A in bf16prefill (magnitude-" in repr(bf)
    x = torch.randn(5, 576)
    assert torch.equal(bf(x), a16(x))
    marks = np.array([0, 1, 1, 0, 1], dtype=np.uint8)
    with lowbit.prompt_rows(marks):
        got = bf(x)
        assert torch.equal(bf(x[:3]), a16(x[:3]))  # another product's rows: not the step's
    on = torch.from_numpy(marks.astype(bool))
    assert torch.equal(got[~on], a16(x)[~on])
    assert 1e-4 < _rel(got[on], a16(x)[on]) < 2e-2
    assert torch.equal(got[on], bf16_kernel.int4_bf16_matmul(x, bf.qweight, bf.scales, bf.mins, marks)[on] + bf.bias)


def test_a_build_without_bf16_products_refuses_the_method_by_name(tmp_path_factory, monkeypatch):
    """The AVX2 build (and any CPU without avx512_bf16) has no bf16 products: its call says so, and
    where Magnitude's kernels are not in use at all the linear is refused, naming the method."""
    avx2 = _build_with(tmp_path_factory, AVX2_FLAGS, "avx2")
    assert not avx2.bf16
    _codes, packed, scales, mins = int4_weights(8, 32, seed=1)
    with pytest.raises(lowbit.LowbitKernelError, match="bf16 products: .* has none"):
        avx2.int4_bf16_matmul(torch.randn(2, 32), packed, scales, mins, np.ones(2, dtype=np.uint8))
    monkeypatch.setenv(lowbit.KERNEL_ENV, "torch")
    with pytest.raises(QuantizationError, match="w4a16-bf16prefill needs Magnitude's low-bit kernels built for a "
                                                "CPU with AVX512-BF16"):
        Int4WeightOnlyLinear(torch.nn.Linear(64, 8), activations="bf16prefill")


@pytest.mark.model
def test_the_fused_step_rounds_the_marked_rows_only(bf16_kernel, tmp_path):
    """A mixed step (decodes, a 23-token chunk, a 9-token prompt) with the chunk and prompt rows
    marked, through the fused step: its decode rows are bit for bit the unmarked step's, its marked
    rows differ from them by bf16's rounding and agree with the lean forward's marked rows to it
    (both round the same products; their other sums run in another order)."""
    runner = _runner(build_tiny_model("qwen2-sliding", tmp_path / "q"), quantization="w4a16-bf16prefill")
    plain, got, lean, on, _snapshot, _step = _marked_mixed_step(runner)
    print(f"\nmarked rows vs w4a16: {_rel(got[on], plain[on]):.1e}, fused vs lean: {_rel(got, lean):.1e} "
          f"on {kernel_description('w4a16-bf16prefill')}")
    assert torch.equal(got[~on], plain[~on])
    assert _rel(got[on], plain[on]) > 10 * TINY_TOLERANCE
    assert _rel(got, lean) < 1e-2


@pytest.mark.model
def test_the_runner_marks_prompt_chunks_and_not_decodes(bf16_kernel, tmp_path):
    """Through the runner: scoring a text in chunks of 16 (prompt rows) gives w4a16's
    log-probabilities to bf16's rounding (relative to their size), not exactly; scored one token a step (decode-shaped rows,
    which the runner does not mark), exactly w4a16's."""
    path = build_tiny_model("llama", tmp_path / "l")
    exact, bf16 = _runner(path, quantization="w4a16"), _runner(path, quantization="w4a16-bf16prefill")
    ids = torch.randint(4, 100, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    a, b = exact.score_tokens(ids, 16), bf16.score_tokens(ids, 16)
    # relative: a random tiny model's logits are large (its log-probabilities reach -40)
    gap = _rel(b, a)
    print(f"\nlog-probabilities over 40 chunked tokens, relative to w4a16's: {gap:.1e} "
          f"on {kernel_description('w4a16-bf16prefill')}")
    assert 0 < gap < 2e-2
    assert torch.equal(exact.score_tokens(ids[:12], 1), bf16.score_tokens(ids[:12], 1))


@pytest.mark.model
def test_its_fused_step_takes_more_keys_than_w4a16s(bf16_kernel, tmp_path):
    """Under w4a16-bf16prefill the fused step takes a step whose chunk attends to more keys than
    FUSED_MAX_CHUNK_KEYS_W4A16, up to FUSED_MAX_CHUNK_KEYS_BF16 (its products are then as cheap in
    both forwards, and its attention still wins); a w4a16 model's fused step declines that step, and
    both take chunks of more than w4a8's FUSED_MAX_CHUNK_ROWS rows and decline one past the _BF16
    bounds. Over an fp32 pool, whose reads were not made cheaper, its keys stop at the _FP32_POOL
    bound, w4a16's own."""
    from magnitude.runner.attention import SeqSlice, build_paged_batch
    from magnitude.runner.fused_decode import (
        FUSED_MAX_CHUNK_KEYS, FUSED_MAX_CHUNK_KEYS_BF16, FUSED_MAX_CHUNK_KEYS_BF16_FP32_POOL, FUSED_MAX_CHUNK_KEYS_W4A16,
        FUSED_MAX_CHUNK_ROWS, FUSED_MAX_CHUNK_ROWS_BF16, FUSED_MAX_CHUNK_ROWS_W4A16, fused_decoder, runs_fused)
    from magnitude.runner.paged_decoder import lean_family

    assert FUSED_MAX_CHUNK_ROWS_BF16 > FUSED_MAX_CHUNK_ROWS
    assert FUSED_MAX_CHUNK_KEYS_BF16 > FUSED_MAX_CHUNK_KEYS_BF16_FP32_POOL > FUSED_MAX_CHUNK_KEYS
    assert FUSED_MAX_CHUNK_KEYS_W4A16 == FUSED_MAX_CHUNK_KEYS_BF16_FP32_POOL
    assert FUSED_MAX_CHUNK_ROWS_W4A16 == FUSED_MAX_CHUNK_ROWS_BF16
    path = build_tiny_model("llama", tmp_path / "l")
    exact = _runner(path, quantization="w4a16", kv_cache_dtype="float16")
    bf16 = _runner(path, quantization="w4a16-bf16prefill", kv_cache_dtype="float16")
    bf16_fp32_pool = _runner(path, quantization="w4a16-bf16prefill", kv_cache_dtype="float32")

    def batch(runner, seqs):  # (tokens cached, tokens this step); block tables are not read
        slices, offset = [], 0
        for cached, n in seqs:
            slices.append(SeqSlice(offset, n, cached, list(range(-(-(cached + n) // 16)))))
            offset += n
        return build_paged_batch(slices, 16, runner.kv.k_layers, runner.kv.v_layers, runner.device)

    def deep(keys: int) -> int:  # 16 rows at s..s+15 attend to 16 s + 136 keys
        return (keys - 136) // 16

    long_chunk = [(100, 1), (0, FUSED_MAX_CHUNK_ROWS + 1)]
    within, past = [(deep(FUSED_MAX_CHUNK_KEYS_BF16), 16)], [(deep(FUSED_MAX_CHUNK_KEYS_BF16) + 1, 16)]
    within_fp32, past_fp32 = ([(deep(FUSED_MAX_CHUNK_KEYS_BF16_FP32_POOL), 16)],
                              [(deep(FUSED_MAX_CHUNK_KEYS_BF16_FP32_POOL) + 1, 16)])
    assert not runs_fused(batch(exact, long_chunk)) and not runs_fused(batch(exact, within))
    chooses = {}
    for name, runner in (("w4a16", exact), ("bf16", bf16), ("bf16 fp32 pool", bf16_fp32_pool)):
        inner = runner.model.model
        forward = fused_decoder(inner, lean_family(inner).window)
        chooses[name] = {k: forward.choose(batch(runner, seqs)) for k, seqs in
                         (("long", long_chunk), ("deep", within), ("past", past),
                          ("deep fp32", within_fp32), ("past fp32", past_fp32),
                          ("too long", [(0, FUSED_MAX_CHUNK_ROWS_BF16 + 1)]))}
    assert chooses["w4a16"] == {"long": True, "deep": False, "past": False, "deep fp32": True, "past fp32": False,
                                "too long": False}
    assert chooses["bf16 fp32 pool"] == {"long": True, "deep": False, "past": False, "deep fp32": True,
                                         "past fp32": False, "too long": False}
    assert chooses["bf16"] == {"long": True, "deep": True, "past": False, "deep fp32": True, "past fp32": True,
                               "too long": False}
