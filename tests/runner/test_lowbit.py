"""Magnitude's low-bit CPU kernels (`runner/lowbit.py`, `lowbit_kernels.c`): built for this CPU, for
AVX2 alone (the 8-lane passes, where the native build has 16), and for no SIMD at all, they must compute the dequantized matmul in fp32, give a row the same bits
whatever rows share its batch and however many threads run, and leave torch's kernels in charge,
with the reason logged, where no compiler is found. Each test prints the CPU and the build it ran."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from magnitude.runner import lowbit  # noqa: E402
from magnitude.runner.defaults import cpu_flags  # noqa: E402
from magnitude.runner.quant_eval import isa_description  # noqa: E402
from magnitude.runner.quantize import (  # noqa: E402
    Int4WeightOnlyLinear, Int8GroupEmbedding, Int8GroupLinear, QuantizationError, WeightOnlyInt8Linear)

# No -march: on x86-64 the build takes the portable C path, the one a CPU without AVX2 runs.
PORTABLE_FLAGS = ("-O2", "-fopenmp", "-shared", "-fPIC")


@pytest.fixture(scope="module")
def native() -> lowbit.LowbitKernels:
    k = lowbit.kernels()
    if k is None:
        pytest.skip(f"no native build here: {lowbit.describe()}")
    return k


def _build_with(tmp_path_factory: pytest.TempPathFactory, flags: tuple[str, ...], isa: str) -> lowbit.LowbitKernels:
    """The kernels built with `flags` into a fresh directory; the build must take the `isa` path."""
    try:
        path = lowbit.build(tmp_path_factory.mktemp(isa), flags=flags)
    except lowbit.LowbitKernelError as e:
        pytest.skip(str(e))
    k = lowbit.load(path)
    assert k.isa == isa
    return k


@pytest.fixture(scope="module")
def portable(tmp_path_factory: pytest.TempPathFactory) -> lowbit.LowbitKernels:
    return _build_with(tmp_path_factory, PORTABLE_FLAGS, "generic")


# The 8-lane AVX2 build on a CPU whose native build is AVX-512 (on an AVX2-only CPU, the native
# build again): each width's passes are checked wherever the CPU can run them.
AVX2_FLAGS = ("-O3", "-march=native", "-mno-avx512f", "-fopenmp", "-shared", "-fPIC")


@pytest.fixture(scope="module")
def avx2(tmp_path_factory: pytest.TempPathFactory) -> lowbit.LowbitKernels:
    if "avx2" not in cpu_flags():
        pytest.skip("this CPU has no AVX2")
    return _build_with(tmp_path_factory, AVX2_FLAGS, "avx2")


@pytest.fixture(params=["native", "avx2", "portable"])
def kernel(request: pytest.FixtureRequest) -> lowbit.LowbitKernels:
    k = request.getfixturevalue(request.param)
    print(f"\nlowbit kernels {k.name} on {isa_description()}")
    return k


def int4_weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] 0..15, packed [N, K/2], scales, mins [N, K/32]) with GGUF-like magnitudes."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    halves = codes.reshape(n, k // 32, 2, 16)
    packed = (halves[:, :, 0] | (halves[:, :, 1] << 4)).to(torch.uint8).reshape(n, k // 2).contiguous()
    scales = torch.rand(n, k // 32, generator=g) * 0.02 + 0.002
    mins = -8 * scales - torch.rand(n, k // 32, generator=g) * 0.01
    return codes, packed, scales, mins


def dequantized_int4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    return (codes.reshape(n, k // 32, 32).double() * scales.double()[..., None]
            + mins.double()[..., None]).reshape(n, k)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 17])
@pytest.mark.parametrize("k,n", [(32, 7), (96, 37), (576, 101)])
def test_int4_matmul_is_the_dequantized_product(kernel, m, k, n):
    codes, packed, scales, mins = int4_weights(n, k, seed=m * 1000 + k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = kernel.int4_matmul(x, packed, scales, mins)
    exact = x.double() @ dequantized_int4(codes, scales, mins).t()
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # fp32 throughout: the error is summation rounding, ~1e-7 relative (a bf16 path would be ~1e-3).
    assert rel(got, exact) < 2e-6, rel(got, exact)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 17])
@pytest.mark.parametrize("k,n", [(32, 7), (96, 37), (576, 101)])
def test_int8_matmul_is_the_dequantized_product(kernel, m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 0.01 + 1e-4
    x = torch.randn(m, k, generator=g)
    got = kernel.int8_matmul(x, codes, scales)
    exact = x.double() @ (codes.double() * scales.double()[:, None]).t()
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert rel(got, exact) < 2e-6, rel(got, exact)


def q8_0_weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [N, K] int8, scales [N, K/32] fp32) as GGUF's Q8_0 stores them: a half-precision scale
    and in every group a code of magnitude 127."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k // 32, 32), generator=g, dtype=torch.int8)
    codes[:, :, 0] = torch.where(torch.rand(n, k // 32, generator=g) < 0.5, 127, -127).to(torch.int8)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).half().float()
    return codes.reshape(n, k), scales


def dequantized_int8g(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    return (codes.reshape(n, k // 32, 32).float() * scales[..., None]).reshape(n, k)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 17])
@pytest.mark.parametrize("k,n", [(32, 7), (96, 37), (576, 101)])
def test_int8g_matmul_is_the_dequantized_product(kernel, m, k, n):
    codes, scales = q8_0_weights(n, k, seed=m + k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = kernel.int8g_matmul(x, codes, scales)
    exact = x.double() @ dequantized_int8g(codes, scales).double().t()
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert rel(got, exact) < 2e-6, rel(got, exact)
    if k > 32:  # a kernel that applied one scale per row (the int8 layout's) would be far off
        assert rel(kernel.int8_matmul(x, codes, scales[:, 0].contiguous()), exact) > 1e-2


def test_q8_0_blocks_come_back_exactly_as_head_and_embedding(native):
    """The de-quantization of Q8_0 blocks (the bundled GGUF's tied embeddings and LM head) maps back
    onto the same codes and scales: the head multiplies exactly those weights, and the embedding
    module built on the head's codes returns the fp32 rows bit for bit, with no fp32 matrix kept."""
    codes, scales = q8_0_weights(300, 576, seed=5)
    w = dequantized_int8g(codes, scales)
    lin = torch.nn.Linear(576, 300, bias=False)
    lin.weight.data.copy_(w)
    head = Int8GroupLinear(lin, native)
    assert head.grid_error == 0.0 and torch.equal(head.qweight, codes) and torch.equal(head.scales, scales)
    x = torch.randn(4, 576)
    assert rel(head(x), x.double() @ w.double().t()) < 2e-6
    embed = Int8GroupEmbedding(head)
    ids = torch.tensor([[0, 299, 17, 17, 5]])
    rows = embed(ids)
    assert rows.dtype == torch.float32 and rows.shape == (1, 5, 576) and torch.equal(rows, w[ids])
    assert embed.codes.data_ptr() == head.qweight.data_ptr() and embed.scales.data_ptr() == head.scales.data_ptr()
    half = Int8GroupEmbedding(head, dtype=torch.bfloat16)  # a bf16 model's rows stay bf16
    assert half(ids).dtype == torch.bfloat16 and torch.equal(half(ids), w[ids].bfloat16())
    # w4a16-int16's head: the same codes, its rows rounded to int16 (any other activations: refused)
    head16 = Int8GroupLinear(lin, native, activations="int16")
    assert torch.equal(head16.qweight, codes) and "A in int16 (magnitude-" in repr(head16)
    assert torch.equal(head16(x), native.int8gq16_matmul(x, codes, scales))
    assert rel(head16(x), q8_rounded(x, lowbit.q16_activations) @ w.double().t()) < 2e-6
    assert 5e-6 < rel(head16(x), x.double() @ w.double().t()) < 1e-4
    with pytest.raises(QuantizationError, match="fp32 or int16 activations, not 'int8'"):
        Int8GroupLinear(lin, native, activations="int8")
    # Off the grid the codes are Q8_0's quantizer's: within half a step of every weight.
    lin.weight.data.normal_()
    rough = Int8GroupLinear(lin, native)
    assert 0.3 < rough.grid_error <= 0.5 + 1e-5
    assert (dequantized_int8g(rough.qweight, rough.scales) - lin.weight).abs().max() <= rough.scales.max() * 0.5001


def q8_rounded(x: torch.Tensor, activations=lowbit.q8_activations) -> torch.Tensor:
    """The activations a w4a8 product multiplies: x rounded per group of 32 (lowbit.q8_activations;
    `activations=lowbit.q16_activations`: a w4a16-int16 decode row's)."""
    q, d = activations(x)
    m, k = x.shape
    return (q.reshape(m, k // 32, 32).double() * d.double()[..., None]).reshape(m, k)


# (product, activations' rounding, its error against the fp32 product: lowest, highest)
INTEGER_ACTIVATIONS = {
    # w4a8: d = max|x| / 127; the fp32 product is ~1e-2 away
    "int4q8_matmul": (lowbit.q8_activations, 1e-4, 1.0),
    # w4a16-int16's decode rows: d = max|x| / 32767; 1.6e-5 to 2.4e-5 away here (AVX2), not int8's 1e-2
    "int4q16_matmul": (lowbit.q16_activations, 5e-6, 1e-4),
    # w4a16-int16's LM head: int16 activations times Q8_0's int8 codes (their own groups of 32)
    "int8gq16_matmul": (lowbit.q16_activations, 5e-6, 1e-4),
}


def integer_product(kernel: lowbit.LowbitKernels, product: str, n: int, k: int,
                    seed: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """(x -> the kernel's `product` of x with random weights, those weights [K, N] in fp64): int4
    codes for the int4 products, Q8_0 blocks for the int8g one."""
    if product.startswith("int8g"):
        codes, scales = q8_0_weights(n, k, seed)
        return (lambda x: getattr(kernel, product)(x, codes, scales)), dequantized_int8g(codes, scales).double().t()
    codes, packed, scales, mins = int4_weights(n, k, seed)
    return (lambda x: getattr(kernel, product)(x, packed, scales, mins)), dequantized_int4(codes, scales, mins).t()


@pytest.mark.parametrize("product", sorted(INTEGER_ACTIVATIONS))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 17])
@pytest.mark.parametrize("k,n", [(32, 7), (96, 37), (576, 101)])
def test_integer_activation_products_are_the_products_of_the_rounded_activations(kernel, product, m, k, n):
    """w4a8 and w4a16-int16 (its int4 products and its int8 LM head): the kernel multiplies x
    rounded per group of 32 (d = max|x| / 127 or / 32767), exactly the rounding `q8_activations` /
    `q16_activations` computes, with integer sums: within fp32's summation order of that product
    (measured under 4e-7; any code rounding one value otherwise would be ~1e-3 off for int8, ~1e-5
    for int16). And it does round, by its own step: the fp32 product is between the bounds
    INTEGER_ACTIVATIONS gives."""
    activations, lowest, highest = INTEGER_ACTIVATIONS[product]
    multiply, w = integer_product(kernel, product, n, k, seed=m * 1000 + k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    if k > 32:
        x[0, :32] = 0  # an all-zero group: d = 0
        x[-1, 32:64] = 1e-38 * torch.rand(32, generator=torch.Generator().manual_seed(k))  # d below FLT_MIN: zero
    got = multiply(x)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert rel(got, q8_rounded(x, activations) @ w) < 2e-6, rel(got, q8_rounded(x, activations) @ w)
    assert lowest < rel(got, x.double() @ w) < highest


@pytest.mark.parametrize("product", sorted(INTEGER_ACTIVATIONS))
def test_integer_products_carry_a_non_finite_activation_into_its_rows_outputs(kernel, product):
    """A NaN or an infinity in a row makes that row's outputs NaN, as the fp32 product's would be,
    and leaves the other rows alone (it is not rounded into a finite integer); a vanishing group
    is zero. Every integer activation product (w4a8's int8, w4a16-int16's int16 and its head's)."""
    multiply, _w = integer_product(kernel, product, 24, 96, seed=1)
    x = torch.randn(3, 96)
    x[0, 40] = float("nan")
    x[2, 5] = float("inf")
    got = multiply(x)
    assert torch.isnan(got[0]).all() and torch.isnan(got[2]).all()
    assert torch.isfinite(got[1]).all()
    assert torch.equal(got[1], multiply(x[1:2].contiguous())[0])
    # A group so small that 1 / d would overflow (d < FLT_MIN) counts as zero, not as garbage.
    tiny = torch.zeros(1, 96)
    tiny[0, :32] = 1e-38
    assert torch.equal(multiply(tiny), torch.zeros(1, 24))


def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads(kernel):
    """A row's bits are the same alone, in any batch (passes of 8, 4, 2, 1 rows or tiles), and with one or
    two threads: the runner and an unbatched reference then agree exactly, and a request's output
    does not depend on what it was batched with."""
    codes, packed, scales, mins = int4_weights(200, 576, seed=3)
    q8 = torch.randint(-127, 128, (200, 576), dtype=torch.int8)
    s8 = torch.rand(200) * 0.01
    x = torch.randn(15, 576)
    batched4 = kernel.int4_matmul(x, packed, scales, mins)
    batched4q8 = kernel.int4q8_matmul(x, packed, scales, mins)
    batched4q16 = kernel.int4q16_matmul(x, packed, scales, mins)
    batched8 = kernel.int8_matmul(x, q8, s8)
    g8, gs = q8_0_weights(200, 576, seed=4)
    batched8g = kernel.int8g_matmul(x, g8, gs)
    batched8gq16 = kernel.int8gq16_matmul(x, g8, gs)
    for r in range(x.shape[0]):
        row = x[r : r + 1].contiguous()
        assert torch.equal(kernel.int4_matmul(row, packed, scales, mins)[0], batched4[r])
        assert torch.equal(kernel.int4q8_matmul(row, packed, scales, mins)[0], batched4q8[r])
        assert torch.equal(kernel.int4q16_matmul(row, packed, scales, mins)[0], batched4q16[r])
        assert torch.equal(kernel.int8_matmul(row, q8, s8)[0], batched8[r])
        assert torch.equal(kernel.int8g_matmul(row, g8, gs)[0], batched8g[r])
        assert torch.equal(kernel.int8gq16_matmul(row, g8, gs)[0], batched8gq16[r])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel.int4_matmul(x, packed, scales, mins), batched4)
        assert torch.equal(kernel.int4q8_matmul(x, packed, scales, mins), batched4q8)
        assert torch.equal(kernel.int4q16_matmul(x, packed, scales, mins), batched4q16)
        assert torch.equal(kernel.int8_matmul(x, q8, s8), batched8)
        assert torch.equal(kernel.int8g_matmul(x, g8, gs), batched8g)
        assert torch.equal(kernel.int8gq16_matmul(x, g8, gs), batched8gq16)
    finally:
        torch.set_num_threads(threads)



@pytest.mark.parametrize("product", sorted(INTEGER_ACTIVATIONS))
def test_integer_products_over_many_channels_keep_a_rows_bits(kernel, product):
    """Past 8 rows the integer passes take the channels in blocks of 256 (lowbit_kernels.c,
    QA_BLOCK_CHANNELS), every pass over one block before the next; 523 channels split between two
    threads leave blocks and 4-channel groups with tails. A row's bits are still its bits alone,
    with one thread or two."""
    multiply, _w = integer_product(kernel, product, 523, 96, seed=9)
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(10))
    batched = multiply(x)
    for r in range(x.shape[0]):
        assert torch.equal(multiply(x[r : r + 1].contiguous())[0], batched[r]), r
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(multiply(x), batched)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("m", [3, 6, 8, 16, 23, 70])
def test_many_rows_take_the_blocked_products_with_the_lone_rows_bits(kernel, m):
    """Where the passes of 8, 4, 2 and 1 rows would take more than one pass (3, 5-7, 9 or more rows:
    a prompt chunk, a head over many decodes), and on AVX2 at 8 rows, the int4, int8 and grouped int8 products convert each
    weight once for up to 64 rows and multiply register tiles (lowbit_kernels.c, DEFINE_BLOCKED);
    every row's bits must still be its bits alone, with one thread or two. The shapes leave tails everywhere: 70 rows are 64 and 6, 203 channels fill no
    tile evenly, and 1,056 inputs are two 512-input blocks and a 32-input one."""
    codes, packed, scales, mins = int4_weights(203, 1056, seed=5)
    g = torch.Generator().manual_seed(6)
    q8 = torch.randint(-127, 128, (203, 1056), generator=g, dtype=torch.int8)
    s8 = torch.rand(203, generator=g) * 0.01
    g8, gs = q8_0_weights(203, 1056, seed=7)
    products = {
        "int4": (lambda x: kernel.int4_matmul(x, packed, scales, mins), dequantized_int4(codes, scales, mins)),
        "int8": (lambda x: kernel.int8_matmul(x, q8, s8), q8.double() * s8.double()[:, None]),
        "int8g": (lambda x: kernel.int8g_matmul(x, g8, gs), dequantized_int8g(g8, gs).double()),
    }
    x = torch.randn(m, 1056)
    threads = torch.get_num_threads()
    for name, (product, weights) in products.items():
        batched = product(x)
        for r in range(m):
            assert torch.equal(product(x[r : r + 1].contiguous())[0], batched[r]), (name, r)
        torch.testing.assert_close(batched.double(), x.double() @ weights.T, rtol=1e-4, atol=1e-3)
        try:
            torch.set_num_threads(1)
            assert torch.equal(product(x), batched), name
        finally:
            torch.set_num_threads(threads)

def test_modules_use_the_native_kernel_and_match_torchs(native, monkeypatch):
    """The w4a16 and int8 weight-only linears built with the kernel agree with the same linears on
    torch's kernels (bf16 activations there, so to bf16's precision), and say which ran."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(576, 96, bias=True)
    x = torch.randn(3, 576)
    fast4, fast8 = Int4WeightOnlyLinear(lin), WeightOnlyInt8Linear(lin, torch.bfloat16)
    monkeypatch.setenv(lowbit.KERNEL_ENV, "torch")
    slow4, slow8 = Int4WeightOnlyLinear(lin), WeightOnlyInt8Linear(lin, torch.bfloat16)
    assert fast4.kernel is native and fast8.kernel is native and slow4.kernel is None and slow8.kernel is None
    assert "fp32 (magnitude-" in repr(fast4) and "bf16 (torch)" in repr(slow4)
    assert "float32 (magnitude-" in repr(fast8) and "bfloat16 (torch)" in repr(slow8)
    print(f"\n{native.name} vs torch on {isa_description()}: int4 {rel(fast4(x), slow4(x)):.1e}, "
          f"int8 {rel(fast8(x), slow8(x)):.1e}")
    assert rel(fast4(x), slow4(x)) < 1e-2 and rel(fast8(x), slow8(x)) < 1e-2
    assert rel(fast4(x), lin(x)) < 0.1 and rel(fast8(x), lin(x)) < 0.02


def test_the_w4a8_linear_runs_the_int8_activation_product_and_is_refused_without_the_kernels(native, monkeypatch):
    """w4a8's module multiplies int8-rounded activations (the same codes as w4a16's, so it sits
    within the rounding of w4a16's product) and says so; where Magnitude's kernels are not in use it
    is refused by name rather than run another way."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(576, 96, bias=True)
    x = torch.randn(3, 576)
    a16, a8 = Int4WeightOnlyLinear(lin), Int4WeightOnlyLinear(lin, activations="int8")
    assert torch.equal(a16.qweight, a8.qweight) and "A in int8 (magnitude-" in repr(a8)
    nibbles = a8.qweight.reshape(96, 18, 16).int()  # a group's inputs 0..15 low, 16..31 high
    w = dequantized_int4(torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(96, 576), a8.scales, a8.mins)
    assert rel(a8(x), q8_rounded(x) @ w.t() + lin.bias.double()) < 2e-6
    print(f"\nw4a8 vs w4a16 on {isa_description()}: {rel(a8(x), a16(x)):.1e}")
    assert 1e-4 < rel(a8(x), a16(x)) < 2e-2
    monkeypatch.setenv(lowbit.KERNEL_ENV, "torch")
    with pytest.raises(QuantizationError, match="w4a8 runs on Magnitude's low-bit kernels only"):
        Int4WeightOnlyLinear(lin, activations="int8")


def test_the_w4a16_int16_linear_takes_decode_rows_in_int16_and_prompt_rows_as_w4a16(native, monkeypatch):
    """w4a16-int16's module multiplies int16-rounded activations, except for the rows
    `lowbit.prompt_rows` marks for a product of that many rows, which it multiplies exactly as w4a16
    does; where Magnitude's kernels are not in use it is refused by name."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(576, 96, bias=True)
    x = torch.randn(5, 576)
    a16, a16i = Int4WeightOnlyLinear(lin), Int4WeightOnlyLinear(lin, activations="int16")
    assert torch.equal(a16.qweight, a16i.qweight) and "A in int16 (magnitude-" in repr(a16i)
    nibbles = a16i.qweight.reshape(96, 18, 16).int()
    w = dequantized_int4(torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(96, 576), a16i.scales, a16i.mins)
    plain = a16i(x)
    assert rel(plain, q8_rounded(x, lowbit.q16_activations) @ w.t() + lin.bias.double()) < 2e-6
    print(f"\nw4a16-int16 vs w4a16 on {isa_description()}: {rel(plain, a16(x)):.1e}")
    assert 5e-6 < rel(plain, a16(x)) < 1e-4
    marks = np.array([0, 1, 1, 0, 1], dtype=np.uint8)
    on = torch.from_numpy(marks.astype(bool))
    with lowbit.prompt_rows(marks):
        got = a16i(x)
        assert torch.equal(a16i(x[:3]), plain[:3])  # another product's rows: not the step's
        assert torch.equal(a16i(x[on]), plain[on])  # nor these, three rows of another product
    assert torch.equal(got[on], a16(x)[on]) and torch.equal(got[~on], plain[~on])
    with lowbit.prompt_rows(np.ones(5, dtype=np.uint8)):
        assert torch.equal(a16i(x), a16(x))
    monkeypatch.setenv(lowbit.KERNEL_ENV, "torch")
    with pytest.raises(QuantizationError, match="w4a16-int16 runs on Magnitude's low-bit kernels only"):
        Int4WeightOnlyLinear(lin, activations="int16")


def test_a_cached_build_is_reused_and_keyed_by_the_cpu(tmp_path, monkeypatch):
    first = lowbit.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert lowbit.build(tmp_path) == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    monkeypatch.setattr(lowbit, "_cpu_identity", lambda: "another CPU")
    other = lowbit.build(tmp_path)
    assert other != first and other.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_concurrent_builds_leave_one_whole_library(tmp_path):
    paths: list[Path] = []
    errors: list[BaseException] = []

    def go() -> None:
        try:
            paths.append(lowbit.build(tmp_path))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=go) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1
    lowbit.load(paths[0])  # loads: not a half-written file
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_without_a_compiler_torch_kernels_serve_and_the_reason_is_logged(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(lowbit, "_loaded", None)
    monkeypatch.setattr(lowbit, "_failure", None)
    with caplog.at_level(logging.WARNING, logger="magnitude.runner.lowbit"):
        assert lowbit.kernels() is None
    assert "no C compiler found" in caplog.text
    assert lowbit.describe().startswith("torch (no C compiler found")
    q = Int4WeightOnlyLinear(torch.nn.Linear(64, 16))
    assert q.kernel is None and q(torch.randn(2, 64)).shape == (2, 16)
    monkeypatch.setenv(lowbit.KERNEL_ENV, "native")
    with pytest.raises(lowbit.LowbitKernelError, match="native: no C compiler found"):
        lowbit.kernels()


def test_a_failing_build_names_the_command_and_the_error(tmp_path, monkeypatch):
    monkeypatch.setattr(lowbit, "SOURCE", tmp_path / "broken.c")
    (tmp_path / "broken.c").write_text("this is not C\n")
    with pytest.raises(lowbit.LowbitKernelError, match=r"broken\.c -lm exited 1: .*error"):
        lowbit.build(tmp_path / "out")


def test_an_unknown_kernel_choice_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(lowbit.KERNEL_ENV, "fast")
    with pytest.raises(lowbit.LowbitKernelError, match="MAGNITUDE_LOWBIT_KERNEL='fast': expected native or torch"):
        lowbit.kernels()


def _float16_cases() -> torch.Tensor:
    """fp32 values whose float16 rounding is easy to get wrong: the midpoint between every two
    neighbouring finite halves, and the fp32 values either side of it (ties to even, subnormal ones
    included), both signs; the bottom (2^-25 is a tie to zero), the top (65520 is the tie to
    infinity), infinities, signed zeros, NaN with payloads; random values at every scale. An odd
    count, so a vector build's 8-lane loop leaves a tail for the scalar one."""
    halves = torch.arange(0, 0x7BFF, dtype=torch.int32).to(torch.int16).view(torch.float16).double()
    mids = ((halves[:-1] + halves[1:]) / 2).float()  # exact in fp32: one bit more than a half
    around = torch.cat([mids, torch.nextafter(mids, torch.tensor(float("inf"))),
                        torch.nextafter(mids, torch.tensor(0.0))])
    edges = [0.0, -0.0, 2.0 ** -25, 2.0 ** -25 * (1 + 2 ** -20), 2.0 ** -26, 65504.0, 65519.99, 65520.0, -65520.0,
             1e6, float("inf"), float("-inf"), 1e-30, -1e-30]
    nans = torch.tensor([0x7FC00000, 0x7FA00000, 0x7F800001, 0xFFC12345 - (1 << 32)], dtype=torch.int32).view(torch.float32)
    gen = torch.Generator().manual_seed(11)
    scales = 10.0 ** torch.randint(-9, 6, (1001,), generator=gen).float()
    return torch.cat([around, -around, torch.tensor(edges), nans, torch.randn(1001, generator=gen) * scales]).float()


@pytest.mark.parametrize("build", ["native", "portable"])
def test_float16_stores_round_as_torch_does(build, request):
    """A float16 KV pool (kvCache.dtype) is written by torch in the lean forward and by the C step
    in the fused one: a sequence's K/V must be the same halves whichever wrote them."""
    assert _float16_cases().numel() % 8
    kernels = request.getfixturevalue(build)
    x = _float16_cases()
    got, want = kernels.to_float16(x), x.to(torch.float16)
    print(f"\nfloat16 stores on {kernels.name}: {int((got.view(torch.int16) != want.view(torch.int16)).sum())} of "
          f"{x.numel()} differ from torch's")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))

