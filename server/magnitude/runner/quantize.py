"""Low-bit weights for the decoder's linear projections and the LM head (CPU): five methods.

- `w4a16` (weight-only, 4-bit): `Int4WeightOnlyLinear` keeps 4-bit weights in groups of 32 input
  channels with a scale and a minimum per group, the layout of GGUF's Q4_1 blocks. A weight that is
  the de-quantization of Q4_1 blocks (the bundled GGUF's decoder linears) lies on that grid
  already, so its 4-bit codes are recovered exactly. Its LM head stays 8-bit, as GGUFs keep the
  output matrix (Q8_0 in the bundled one). Where Magnitude's own kernels are built (runner/lowbit.py:
  this CPU's C compiler, at first use) the activations stay fp32, so the decoder's products are the
  fp32 model's up to summation order, and the head is int8 in Q8_0's groups of 32
  (`Int8GroupLinear`, exact on Q8_0 blocks) with tied embeddings read from its codes
  (`Int8GroupEmbedding`); else torch's kernels run with bf16 activations, scales and outputs (their
  fast path), which is what the "a16" of the name stands for, and the head is int8 per output
  channel (`WeightOnlyInt8Linear`). `lowbit.describe()` says which ran.
- `w4a8`: w4a16's weights (the same codes, the same LM head and embeddings), with each decoder product's
  input rounded to int8 per group of 32 inputs (d = max|x| / 127) and multiplied by integer dot
  products: GGUF's Q4_1 x Q8_1, what llama.cpp runs for these weights. The weights are never
  converted to fp32, so a one-row product runs near memory speed (lowbit_kernels.c has the
  figures); the activation rounding is its error, which its evaluation record measures. Magnitude's
  kernels only: refused where they are not built.
- `w4a16-int16`: w4a16's weights, LM head and embeddings; a decode's products round their input
  to int16 per group of 32 (d = max|x| / 32767, an error 1/256 of w4a8's) and multiply with integer
  dot products (`pmaddwd`), which at one or two rows take about half the instructions of converting
  every weight to fp32; the rows of a prompt chunk are multiplied exactly as w4a16 multiplies them
  (chunks are arithmetic-bound, where fp32's register tiles are faster). The LM head takes every
  row it multiplies in int16 (its int8 codes need only widening: faster than fp32 up to about 16
  rows, about even past that).
  Magnitude's kernels only.
- `w4a16-bf16prefill`: w4a16's weights, LM head and embeddings; a decode's products exactly as
  w4a16's, while the rows of a prompt chunk (a step's sequence with more than one token) are rounded
  to bf16 and multiplied by the weights rounded to bf16 with AVX512-BF16 dot products, fp32 sums
  (lowbit_kernels.c: a chunk's products 3x as fast as fp32's on a Zen 4 core). Prefill is
  arithmetic-bound and decode memory-bound, so the rounding goes where the time is; its evaluation
  record measures what it costs. Needs Magnitude's kernels built for a CPU with AVX512-BF16 (AMX
  CPUs have it too): refused elsewhere.
- `w8a16` (weight-only): `WeightOnlyInt8Linear` keeps int8 weights with one scale per output
  channel and multiplies activations in the model's dtype (Magnitude's kernel in fp32, else
  `torch._weight_int8pack_mm`). No activation rounding, so its error is the weights' alone
  (top-1 agreement with fp32 0.971, mean KL 0.004, `bench/int8_quality.py`) and its numerics are
  as stable as the unquantized model's.
- `w8a8` (`int8` is its earlier name): described below.

The evaluation record (`runner/quant_eval.py`) measures either against the unquantized model
before the engine serves it.

`quantize_linears(model, "w8a8", device, calibration_ids)` swaps every `nn.Linear` inside the
decoder layers (q/k/v/o and the MLP's gate/up/down) and the LM head for an `Int8Linear`: weights
int8 with one symmetric scale per output channel, activations quantized per token at run time,
products in `torch._int_mm` (int8 x int8 -> int32; 3-4x an fp32 matmul at 8-128 rows with AVX-512
VNNI), or, where that kernel is a slow reference loop (AVX2-only CPUs), exactly the same integers
through float32 BLAS (`int8_kernel`). Embeddings, norms and attention stay in the model's dtype (attention sums in fp32 over
the KV cache, which `kvCache.dtype` keeps in float16 beside quantized weights by default). The LM head is included because it is memory-bound: 12 rows
through the fp32 49k x 576 head took 18 ms a step, int8 3.3 ms (`bench/step_profile.py`), for a
mean KL to fp32 of 0.021 instead of 0.016 with the head in fp32 (`bench/int8_quality.py`).

Per-token activation quantization is where the error comes from (a few input channels carry
outliers that flatten every other channel to a few levels). SmoothQuant's remedy (Xiao et al.,
2023) is applied per linear: one forward over a fixed calibration text records each input
channel's largest |x|; the channel is divided by s = |x|max^0.5 / |w|max^0.5 before quantizing and
the weight's column multiplied by it, which moves the outliers into the weights, where per-channel
scales absorb them. Measured on SmolLM2-135M against fp32 over 239 tokens the calibration never
saw (`bench/int8_quality.py`), decoder linears only: top-1 agreement 0.895 -> 0.941, mean KL
0.041 -> 0.016; with the int8 LM head too (what ships) 0.937 / 0.021; weight-only int8 0.971 / 0.004.

Why w8a8's output depends on the CPU and on the batch: rounding x * 127 / max|x| to integers turns
a one-ulp difference in an fp32 activation (SDPA's reduction order differs with the batch's shape
and padding and with the CPU's kernels: AVX2, AVX-512, AMX) into a whole quantization step, about
10^5 times the fp32 noise. Measured here, the same quantized model run alone and batched differs
by up to 0.3 nats in a token's log-probability (0.54 with ATEN_CPU_CAPABILITY=default), so greedy
output flips wherever the top two logits are that close (two of the runner tests' six prompts:
margins 0.013 and 0.0003). Its tests therefore bound the runner's deviation per token instead of
asking for token-for-token equality (tests/runner/test_int8.py).

The model classes stay transformers' own: only leaf modules are replaced, so the paged attention,
`generate` and the tests' HF reference all run the same quantized model.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch
from torch import nn

from magnitude.runner import QUANTIZATIONS, canonical_quantization, lowbit
from magnitude.runner.file_pages import drop_pages, file_backed_ranges, in_ranges, trim_heap

# The range a symmetric int8 scale maps onto; -128 is left unused so that x and -x quantize alike.
_QMAX = 127.0
SMOOTHING_ALPHA = 0.5  # 0.3 / 0.5 / 0.65 / 0.8 measured: KL 0.025 / 0.016 / 0.020 / 0.050

# Calibration text: chat, code, numbers, markup. Fixed, so the same model quantizes the same way on
# every start (the tests' HF reference re-quantizes its own copy and must get identical weights).
CALIBRATION_TEXT = (
    "You are a helpful assistant. Answer the user's questions clearly and briefly. "
    "User: How do I sort a list in Python? Assistant: Use sorted(items) for a new list or items.sort() in place. "
    "User: Summarize the water cycle. Assistant: Water evaporates, condenses into clouds, falls as rain or snow, "
    'and flows back to the sea. 1, 2, 3, 4, 5. {"name": "value", "n": 42} <html><body>Hello</body></html>'
)


# w4a16's group: 32 input channels, as GGUF's Q4_0/Q4_1 blocks.
INT4_GROUP = 32


class QuantizationError(ValueError):
    """A quantization this runner cannot apply (unknown name, unsupported device)."""


# An int8 x int8 product summed over at most this many terms stays below 2^24 (1024 * 127 * 127),
# so float32 holds every partial sum exactly: a float32 matmul over such a slice of K is an exact
# integer matmul, whatever order the BLAS adds in.
_EXACT_FP32_K = 1024
INT8_KERNEL_ENV = "MAGNITUDE_INT8_KERNEL"
_int8_kernel: str | None = None


def int8_kernel() -> str:
    """How w8a8 multiplies: "int_mm" (torch._int_mm) or "fp32" (exact integer products through
    float32 BLAS over K slices of at most 1,024). Both give the same int32 results bit for bit;
    only speed differs, so the choice is measured once per process, on the model's most common
    shape: on CPUs without VNNI or AMX, torch._int_mm runs a reference loop (measured on an AVX2
    EPYC: 26.7 ms for 6 x 576 x 1536 against 2.2 ms in fp32, 2 s for the LM head at 6 rows).
    `MAGNITUDE_INT8_KERNEL=int_mm|fp32` forces one (tests compare them)."""
    global _int8_kernel
    forced = os.environ.get(INT8_KERNEL_ENV)
    if forced:
        if forced not in ("int_mm", "fp32"):
            raise QuantizationError(f"{INT8_KERNEL_ENV}={forced!r}: expected int_mm or fp32")
        return forced
    if _int8_kernel is None:
        x = torch.randint(-127, 128, (16, 576), dtype=torch.int8)
        w = torch.randint(-127, 128, (576, 1536), dtype=torch.int8)
        chunks = _fp32_chunks(w)
        timings = {}
        for name, fn in (("int_mm", lambda: torch._int_mm(x, w)), ("fp32", lambda: int8_matmul_fp32(x, chunks))):
            fn()
            t0 = time.perf_counter()
            for _ in range(3):
                fn()
            timings[name] = time.perf_counter() - t0
        _int8_kernel = min(timings, key=timings.get)
    return _int8_kernel


def _fp32_chunks(w: torch.Tensor) -> list[torch.Tensor]:
    """An int8 [K, N] right operand as float32 slices of at most _EXACT_FP32_K rows."""
    return [w[k : k + _EXACT_FP32_K].float() for k in range(0, w.shape[0], _EXACT_FP32_K)]


def int8_matmul_fp32(x: torch.Tensor, w_chunks: list[torch.Tensor]) -> torch.Tensor:
    """x [M, K] int8 @ w [K, N] (as `_fp32_chunks`) -> int32, exactly: each slice's float32 sums
    are integers below 2^24; slices are added in int32."""
    out: torch.Tensor | None = None
    k = 0
    for chunk in w_chunks:
        part = (x[:, k : k + chunk.shape[0]].float() @ chunk).to(torch.int32)
        out = part if out is None else out.add_(part)
        k += chunk.shape[0]
    assert out is not None
    return out


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W in int8 (per-output-channel scales) and x quantized per row.

    With `input_absmax` (each input channel's calibrated largest |x|), x is smoothed first:
    y = (x / s) (W s)^T, so outlier channels are carried by the weight instead of the activation."""

    def __init__(self, linear: nn.Linear, input_absmax: torch.Tensor | None = None,
                 alpha: float = SMOOTHING_ALPHA) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        inv_smooth = None
        if input_absmax is not None:
            smooth = (input_absmax.float().clamp(min=1e-5).pow(alpha)
                      / w.abs().amax(dim=0).clamp(min=1e-5).pow(1 - alpha)).clamp(min=1e-5)
            w = w * smooth
            inv_smooth = 1.0 / smooth
        self.register_buffer("input_inv_smooth", inv_smooth)
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / _QMAX
        # Stored as [in, out] contiguous: the layout `_int_mm` wants for its right operand.
        self.register_buffer("qweight_t", torch.round(w / scale[:, None]).to(torch.int8).t().contiguous())
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # float32 copies of the int8 weights, only where the fp32 kernel is the faster exact one
        self._fp32_chunks = _fp32_chunks(self.qweight_t) if int8_kernel() == "fp32" else None

    def _int_mm(self, xq: torch.Tensor) -> torch.Tensor:
        if self._fp32_chunks is not None:
            return int8_matmul_fp32(xq, self._fp32_chunks)
        return torch._int_mm(xq, self.qweight_t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        if self.input_inv_smooth is not None:
            x2 = x2 * self.input_inv_smooth
        row_max = x2.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)
        xq = (x2 * (_QMAX / row_max)).round_().to(torch.int8)
        y = self._int_mm(xq).float()
        y.mul_(row_max * (1.0 / _QMAX)).mul_(self.weight_scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel W, per-row A"


def _fp32_rows(x: torch.Tensor, features: int) -> torch.Tensor:
    """x as contiguous fp32 rows [M, features], for Magnitude's kernels. A decode step calls this
    ~120 times: no-op conversions are skipped, not made (each costs microseconds of framework time,
    as much as a small product's arithmetic)."""
    if x.dtype == torch.float32 and x.is_contiguous():
        return x.view(-1, features)
    return x.reshape(-1, features).float().contiguous()


def _native_output(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A kernel's fp32 product [M, N] plus the bias, in x's dtype and leading shape."""
    if bias is not None:
        y += bias
    return (y if x.dtype == torch.float32 else y.to(x.dtype)).view(*x.shape[:-1], y.shape[-1])


class WeightOnlyInt8Linear(nn.Module):
    """y = x (W_q s)^T (+ b): int8 weights with one scale per output channel; x stays in its dtype.

    Multiplies through Magnitude's kernel (runner/lowbit.py: x in fp32, each weight decoded once per
    8 rows) where it is built, else through `torch._weight_int8pack_mm`."""

    def __init__(self, linear: nn.Linear, activation_dtype: torch.dtype | None = None) -> None:
        """`activation_dtype`: what x is cast to for torch's kernel (default: the weight's dtype).
        bf16 is that kernel's fast path on AVX2: the LM head at one row 6.3 ms against 32 ms with
        fp32 activations (`bench/step_profile.py`), so w4a16 asks for it for its head. Magnitude's
        kernel takes fp32 activations, at 2.6 ms for the same head (`bench/lowbit_bench.py`)."""
        super().__init__()
        def channel_codes(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            rows = rows.float()
            scale = rows.abs().amax(dim=1).clamp(min=1e-12) / _QMAX
            return torch.round(rows / scale[:, None]).to(torch.int8), scale

        codes, scale = (torch.cat(parts) for parts in zip(*map(channel_codes, row_passes(linear.weight.detach()))))
        self.kernel = lowbit.kernels() if linear.in_features % lowbit.K_MULTIPLE == 0 else None
        # [out, in] contiguous int8: what either kernel takes; the scales in the kernel's dtype.
        self.register_buffer("qweight", codes.contiguous())
        scale_dtype = torch.float32 if self.kernel is not None else activation_dtype or linear.weight.dtype
        self.register_buffer("weight_scale", scale.to(scale_dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.kernel is not None:
            return _native_output(self.kernel.int8_matmul(_fp32_rows(x, self.in_features), self.qweight,
                                                          self.weight_scale), x, self.bias)
        x2 = x.reshape(-1, self.in_features).to(self.weight_scale.dtype).contiguous()
        y = torch._weight_int8pack_mm(x2, self.qweight, self.weight_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = self.kernel.name if self.kernel is not None else "torch"
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel W, "
                f"A in {str(self.weight_scale.dtype).removeprefix('torch.')} ({kernel})")


def int4_codes(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (codes [N, K] int32 in 0..15, scale [N, K/group], minimum [N, K/group]):
    asymmetric round-to-nearest per group, w ~ codes * scale + minimum: Q4_1's own quantizer
    (minimum = the group's smallest weight, scale = its range / 15), so the de-quantization of Q4_1
    blocks maps back onto the same codes."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo = g.amin(dim=-1)
    scale = (g.amax(dim=-1) - lo) / 15.0
    # A constant group has range 0: any scale reproduces it with code 0.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((g - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.int32)
    return codes.reshape(n, k), scale, lo


def _grid_error(recon: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> float:
    """The largest |w - recon| in units of its group's scale (0 for a constant group): recon
    [N, G, group] de-quantized codes, w [N, K], scale [N, G]. ~0 when w was on the grid already."""
    err = (recon - w.float().reshape(recon.shape)).abs().amax(dim=-1)
    return float((err / scale.clamp(min=1e-30)).where(scale > 0, torch.zeros_like(err)).max())


# Rows quantized in one pass. The fp32 temporaries of a pass (the group view's arithmetic, the
# de-quantization the grid error is measured on) are a few times the rows' own size: SmolLM2's
# tied LM head (49,152 x 576) in one pass raised the process's peak by ~480 MiB while loading,
# above everything it holds once loaded (/tmp probe of VmRSS during quantize_linears, stop 30).
QUANTIZE_ROWS_PER_PASS = 4096


def row_passes(w: torch.Tensor) -> list[torch.Tensor]:
    """w's rows in views of QUANTIZE_ROWS_PER_PASS (the last one shorter)."""
    return list(w.split(QUANTIZE_ROWS_PER_PASS))


def codes_by_rows(w: torch.Tensor, codes_of: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
                  dequantize: Callable[..., torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], float]:
    """`codes_of` (int4_codes, int8_group_codes: tensors with a row per output row, the scales
    second) over QUANTIZE_ROWS_PER_PASS rows of w [N, K] at a time, concatenated, and the grid error
    (_grid_error) of `dequantize(*codes)` [rows, G, group] against w over all passes: the same codes
    and the same error as one pass, with the temporaries of one pass only."""
    passes: list[tuple[torch.Tensor, ...]] = []
    error = 0.0
    views = row_passes(w)
    mapped = file_backed_ranges() if len(views) > 1 else []
    for rows in views:
        got = codes_of(rows)
        error = max(error, _grid_error(dequantize(*got), rows, got[1]))
        passes.append(got)
        if len(views) > 1:
            # A large weight (an LM head tied to the embeddings: 113 MiB in SmolLM2 fp32) would
            # otherwise hold its whole mapping and every pass's freed temporaries at once, at its end:
            # a first start's peak. Its pages come back from the file if it is read again.
            drop_pages(rows, mapped)
            trim_heap()
    return tuple(torch.cat(parts) for parts in zip(*passes)), error


def int8_group_codes(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (codes [N, K] int8, scale [N, K/group] fp32): symmetric round-to-nearest per
    group, w ~ codes * scale with scale = max|w| / 127: GGUF Q8_0's quantizer, so the de-quantization
    of Q8_0 blocks (scale * code, the largest |code| 127) maps back onto the same codes and scales."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    scale = g.abs().amax(dim=-1) / _QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: codes 0
    codes = torch.round(g / safe[..., None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return codes.reshape(n, k), scale


class Int8GroupLinear(nn.Module):
    """y = x W^T (+ b) with W int8 in groups of 32 input channels, one scale each (GGUF Q8_0's
    layout), through Magnitude's kernel (runner/lowbit.py) with x, the scales and y in fp32: on
    weights that are the de-quantization of Q8_0 blocks (the bundled GGUF's LM head, tied to its
    token embeddings) every weight is exact and the product is the fp32 model's up to summation
    order. w4a16's, w4a8's and w4a16-int16's LM head where the kernels are built (else
    `WeightOnlyInt8Linear`).
    `activations="int16"` (w4a16-int16's head): every row it multiplies rounded to int16 per group
    of 32 inputs (`lowbit.q16_activations`) and integer dot products, at any number of rows, so a
    row's logits do not depend on its batch (lowbit_kernels.c has the speeds).

    `grid_error`: the largest |W - codes * scale| relative to the group's scale (~0 on Q8_0 blocks,
    up to 0.5 otherwise)."""

    def __init__(self, linear: nn.Linear, kernel: "lowbit.LowbitKernels", group: int = INT4_GROUP,
                 activations: str = "fp32") -> None:
        super().__init__()
        if activations not in ("fp32", "int16"):
            raise QuantizationError(f"an int8 group LM head multiplies fp32 or int16 activations, not {activations!r}")
        self.activations = activations
        w = linear.weight.detach()
        n, k = w.shape
        if k % group:
            raise QuantizationError(f"int8 groups of {group} need input features divisible by {group}; got {k}")
        (codes, scale), self.grid_error = codes_by_rows(
            w, lambda rows: int8_group_codes(rows, group),
            lambda codes, scale: codes.float().reshape(*scale.shape, group) * scale[..., None])
        self.kernel = kernel
        self.register_buffer("qweight", codes.contiguous())
        self.register_buffer("scales", scale.float().contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features = k
        self.out_features = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = self.kernel.int8gq16_matmul if self.activations == "int16" else self.kernel.int8g_matmul
        return _native_output(product(_fp32_rows(x, self.in_features), self.qweight, self.scales), x, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 W (groups of 32, a "
                f"scale each), A in {self.activations} ({self.kernel.name})")


class Int8GroupEmbedding(nn.Module):
    """Token embeddings tied to an `Int8GroupLinear` LM head, read from the head's own codes and
    scales: a row is codes * scale in fp32 (exactly the stored Q8_0 blocks' values), so no fp32
    copy of the matrix is kept (SmolLM2: 108 MiB). Replaces an `nn.Embedding` whose weight is the
    LM head's (tied) and does nothing else (no max_norm)."""

    def __init__(self, head: Int8GroupLinear, padding_idx: int | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        """`dtype`: what the replaced embedding returned (the model's dtype), so the residual
        stream after it is what it was."""
        super().__init__()
        self.register_buffer("codes", head.qweight)  # the same tensors: one copy for both
        self.register_buffer("scales", head.scales)
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.padding_idx = padding_idx
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        groups = self.scales.shape[1]
        rows = self.codes[input_ids].view(*input_ids.shape, groups, self.embedding_dim // groups)
        out = (rows.float() * self.scales[input_ids][..., None]).view(*input_ids.shape, self.embedding_dim)
        return out if self.dtype == torch.float32 else out.to(self.dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, int8 (groups of 32), tied to the LM head, "
                f"rows in {str(self.dtype).removeprefix('torch.')}")


def _tied_embedding(model: nn.Module, head: nn.Linear) -> nn.Embedding | None:
    """The decoder's token embedding when it is a plain `nn.Embedding` sharing the LM head's weight."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if type(embed) is nn.Embedding and embed.weight is head.weight and embed.max_norm is None:
        return embed
    return None


def _bf16prefill_unavailable() -> QuantizationError:
    """w4a16-bf16prefill needs the bf16 products: the refusal where the kernels lack them, and why."""
    return QuantizationError("w4a16-bf16prefill needs Magnitude's low-bit kernels built for a CPU with AVX512-BF16 "
                             f"(avx512_bf16 in /proc/cpuinfo), and here they are not ({lowbit.describe()}); use w4a16")


INT4_ACTIVATIONS = {"fp32": "w4a16", "int8": "w4a8", "int16": "w4a16-int16",
                    "bf16prefill": "w4a16-bf16prefill"}  # -> method
INTEGER_ACTIVATIONS = ("int8", "int16")  # Magnitude's kernels only: torch has no such product
# Kinds whose products take the rows `lowbit.prompt_rows` marks apart (bf16 products; fp32 ones), and
# their methods, for which the runner marks a step's prompt rows.
PROMPT_ROW_ACTIVATIONS = ("bf16prefill", "int16")
PROMPT_ROW_METHODS = tuple(INT4_ACTIVATIONS[a] for a in PROMPT_ROW_ACTIVATIONS)


def _integer_activations_unavailable(method: str) -> QuantizationError:
    """w4a8 and w4a16-int16 have no torch fallback: the refusal where Magnitude's kernels are not in
    use, and why."""
    return QuantizationError(f"{method} runs on Magnitude's low-bit kernels only, and they are not in use here "
                             f"({lowbit.describe()}); use w4a16")


class Int4WeightOnlyLinear(nn.Module):
    """y = x W^T (+ b) with W in 4-bit groups of 32 input channels (a scale and a minimum each); the
    result is returned in x's dtype.

    Two kernels, chosen when the module is built:
    - Magnitude's (runner/lowbit.py), where it is built: x, the scales and minimums and y in fp32,
      so on Q4_1-grid weights the product is the fp32 model's up to summation order;
    - else torch's `_weight_int4pack_mm_for_cpu`, with x, the scales and y rounded to bf16 (its fast
      path; fp32 activations run a scalar loop on AVX2).

    `activations="int8"` (w4a8) rounds x to int8 per group of 32 inputs (`lowbit.q8_activations`)
    and multiplies with integer dot products, Magnitude's kernels only (QuantizationError where they
    are not built); `activations="int16"` (w4a16-int16) the same with int16 (`lowbit.q16_activations`)
    for all but the rows `lowbit.prompt_rows` marks for the step, which it multiplies as w4a16 does.
    `activations="bf16prefill"` (w4a16-bf16prefill) multiplies the rows that `lowbit.prompt_rows`
    marks for the step in bf16 and the others as w4a16 does, Magnitude's kernels with AVX512-BF16
    only.

    `grid_error` is the largest |W - dequant(codes)| relative to the group's scale: ~0 when W was
    already on a 4-bit grid (de-quantized Q4_1), up to 0.5 otherwise."""

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP, activations: str = "fp32") -> None:
        super().__init__()
        w = linear.weight.detach()
        n, k = w.shape
        if activations not in INT4_ACTIVATIONS:
            raise ValueError(f"activations {activations!r}: expected one of {', '.join(INT4_ACTIVATIONS)}")
        method = INT4_ACTIVATIONS[activations]
        if k % group:
            raise QuantizationError(f"{method} needs input features divisible by {group}; a linear has {k}")
        (codes, scale, lo), self.grid_error = codes_by_rows(
            w, lambda rows: int4_codes(rows, group),
            lambda codes, scale, lo: codes.reshape(*scale.shape, group).float() * scale[..., None] + lo[..., None])
        self.kernel = lowbit.kernels() if group == lowbit.K_MULTIPLE else None
        if activations in INTEGER_ACTIVATIONS and self.kernel is None:
            raise _integer_activations_unavailable(method)
        if activations == "bf16prefill" and (self.kernel is None or not self.kernel.bf16):
            raise _bf16prefill_unavailable()
        self.activations = activations
        if self.kernel is not None:
            # Two codes a byte, a group's first 16 inputs in the low nibbles (Q4_1's order).
            halves = codes.reshape(n, k // group, 2, group // 2)
            self.register_buffer("qweight", (halves[:, :, 0] | (halves[:, :, 1] << 4)).to(torch.uint8)
                                 .reshape(n, k // 2).contiguous())
            self.register_buffer("scales", scale.float().contiguous())
            self.register_buffer("mins", lo.float().contiguous())
        else:
            # torch's convention: w = (code - 8) * scale + zero, so zero = minimum + 8 * scale.
            self.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
            self.register_buffer("scales_and_zeros",
                                 torch.stack([scale.t(), (lo + 8.0 * scale).t()], dim=-1).to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features = k
        self.out_features = n
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.kernel is not None:
            rows = _fp32_rows(x, self.in_features)
            marked = lowbit.current_prompt_rows(rows.shape[0]) if self.activations in PROMPT_ROW_ACTIVATIONS else None
            if marked is not None and self.activations == "bf16prefill":
                y = self.kernel.int4_bf16_matmul(rows, self.qweight, self.scales, self.mins, marked)
            elif marked is not None and marked.all():  # w4a16-int16, a prompt-only step: w4a16's products
                y = self.kernel.int4_matmul(rows, self.qweight, self.scales, self.mins)
            elif marked is not None:  # w4a16-int16: prompt rows as w4a16's, the others in int16
                prompt = torch.from_numpy(marked.astype(bool))
                y = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
                y[prompt] = self.kernel.int4_matmul(rows[prompt], self.qweight, self.scales, self.mins)
                y[~prompt] = self.kernel.int4q16_matmul(rows[~prompt], self.qweight, self.scales, self.mins)
            else:
                product = {"int8": self.kernel.int4q8_matmul,
                           "int16": self.kernel.int4q16_matmul}.get(self.activations, self.kernel.int4_matmul)
                y = product(rows, self.qweight, self.scales, self.mins)
            return _native_output(y, x, self.bias)
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales_and_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        activations = (f"A in {self.activations} ({self.kernel.name})" if self.kernel is not None
                       else "A in bf16 (torch)")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"4-bit W (groups of {self.group}, scale + min), {activations}")


# Linears of one module that transformers' model classes call one after another on the same input
# tensor (Llama, Mistral, Qwen, Gemma: attention's q/k/v, the MLP's gate/up). w4a16 multiplies each
# group as one matrix: at batch 1 a step is mostly per-call overhead (one int4 call ~0.1 ms of
# compute, plus the bf16 casts), and fusing turns 7 calls per layer into 4.
FUSED_INPUT_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Int4Group:
    """One fused int4 product for linears that share their input; the first member called with a
    new input computes all of them, the others take their slice. Holding the last input makes the
    identity check safe (the tensor cannot be freed and its id reused while held)."""

    def __init__(self, fused: "Int4WeightOnlyLinear", sizes: list[int]) -> None:
        self.fused = fused
        self.sizes = sizes
        self._x: torch.Tensor | None = None
        self._outs: tuple[torch.Tensor, ...] = ()

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self._x is not x:
            self._outs = self.fused(x).split(self.sizes, dim=-1)
            self._x = x
        return self._outs[index]


class Int4FusedMember(nn.Module):
    """A linear of a fused w4a16/w4a8 group: its slice of the group's product. The fused weights are a
    submodule of the first member only, so they are counted once."""

    def __init__(self, group: Int4Group, index: int, out_features: int) -> None:
        super().__init__()
        if index == 0:
            self.fused = group.fused
        self.fused_group = group
        self.index = index
        self.in_features = group.fused.in_features
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused_group.output(x, self.index)

    def extra_repr(self) -> str:
        return f"member {self.index} of a fused int4 product, out_features={self.out_features}"


def _fuse_int4(parent: nn.Module, names: tuple[str, ...], members: list[nn.Linear], activations: str = "fp32") -> None:
    """Replace `members` (same input features) by slices of one Int4WeightOnlyLinear over their
    stacked rows: per-group codes and scales are per output row, so stacking changes no code."""
    stacked = nn.Linear(members[0].in_features, sum(m.out_features for m in members),
                        bias=any(m.bias is not None for m in members), device="meta")
    stacked.weight = nn.Parameter(torch.cat([m.weight.detach() for m in members]), requires_grad=False)
    if stacked.bias is not None:
        stacked.bias = nn.Parameter(torch.cat([m.bias.detach() if m.bias is not None else
                                               torch.zeros(m.out_features, dtype=m.weight.dtype) for m in members]),
                                    requires_grad=False)
    group = Int4Group(Int4WeightOnlyLinear(stacked, activations=activations), [m.out_features for m in members])
    for i, (name, m) in enumerate(zip(names, members)):
        setattr(parent, name, Int4FusedMember(group, i, m.out_features))


def check_quantization(quantization: str | None, device: torch.device) -> str:
    """The quantization method (canonical name) if this runner can apply it on `device`;
    QuantizationError naming the value otherwise. Cheap: callers check before loading a model."""
    if (quantization or "none") not in QUANTIZATIONS:
        raise QuantizationError(f"quantization {quantization!r}: expected one of {', '.join(QUANTIZATIONS)}")
    q = canonical_quantization(quantization)
    if q != "none" and device.type != "cpu":
        # The int8 kernels used here are validated on the CPU only (torch._int_mm on CUDA needs
        # more than 16 rows); bf16 is the weight format to use on a GPU.
        raise QuantizationError(f"{q} weights are implemented for the CPU only (device {device.type}); use bf16")
    return q


def quantization_targets(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every linear of the decoder layers, then the LM head."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise QuantizationError(f"{type(model).__name__} has no decoder layers to quantize")
    targets = [(parent, name, child) for layer in layers for parent in layer.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        targets.append((model, "lm_head", model.lm_head))
    return targets


def quantize_linears(model: nn.Module, quantization: str | None, device: torch.device,
                     calibration_ids: list[int] | None = None) -> int:
    """Apply `quantization` in place to the decoder layers' linears and the LM head; returns how
    many modules were replaced.
    w8a8 with `calibration_ids` (e.g. the tokenized CALIBRATION_TEXT) smooths the activations."""
    method = check_quantization(quantization, device)
    if method == "none":
        return 0
    replaced = _replace_linears(model, method, device, calibration_ids)
    _own_unquantized_parameters(model)
    return replaced


def _own_unquantized_parameters(model: nn.Module) -> None:
    """Copy the parameters and buffers quantization left in the model's dtype (embeddings, norms)
    out of the mapped checkpoint into memory of their own. Loading maps the checkpoint file and
    every parameter is a view of that mapping; the few views left after quantizing keep the whole
    mapping, and every page of it that loading and quantizing read, resident: for SmolLM2 fp32 +
    w4a16, 513 MiB of file pages held for 113 MiB of embeddings (`bench/step_profile.py --memory`).
    Tensors not in a file mapping (a checkpoint converted while loading) are left as they are."""
    mapped = file_backed_ranges()
    for p in model.parameters():  # tied parameters come once
        if in_ranges(p.data, mapped):
            p.data = p.data.clone()
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and in_ranges(b, mapped):
                module._buffers[name] = b.clone()


TRIM_EVERY = 8  # linears replaced between two trims of glibc's heap while quantizing


def _replace_linears(model: nn.Module, method: str, device: torch.device, calibration_ids: list[int] | None) -> int:
    targets = quantization_targets(model)
    mapped = file_backed_ranges()

    replaced = 0

    def trim_now_and_then() -> None:
        # Each linear's fp32 temporaries are freed into glibc's arenas between the codes kept, where
        # they would stay resident until loading ends: the load's peak, not its end, bounds a pod.
        # Every TRIM_EVERY linears: a trim walks every arena, and trimming after each of SmolLM2's
        # 211 linears added a second to its load for the same peak.
        nonlocal replaced
        replaced += 1
        if replaced % TRIM_EVERY == 0:
            trim_heap()

    def replace(parent: nn.Module, name: str, quantized: nn.Module, linear: nn.Linear) -> None:
        setattr(parent, name, quantized)
        drop_pages(linear.weight, mapped)
        trim_now_and_then()

    if method == "w8a16":
        for parent, name, child in targets:
            replace(parent, name, WeightOnlyInt8Linear(child), child)
        return len(targets)
    if method in INT4_ACTIVATIONS.values():
        activations = next(a for a, m in INT4_ACTIVATIONS.items() if m == method)
        bad = [f"{name} ({c.in_features})" for _, name, c in targets if c.in_features % INT4_GROUP]
        if bad:  # before replacing any: a half-quantized model would be neither method
            raise QuantizationError(f"{method} needs input features divisible by {INT4_GROUP}: {', '.join(bad)}")
        if activations in INTEGER_ACTIVATIONS and lowbit.kernels() is None:  # also before replacing any
            raise _integer_activations_unavailable(method)
        if method == "w4a16-bf16prefill" and (lowbit.kernels() is None or not lowbit.kernels().bf16):
            raise _bf16prefill_unavailable()
        fused: set[int] = set()
        for parent in {id(p): p for p, _, _ in targets}.values():
            for names in FUSED_INPUT_SIBLINGS:
                members = [getattr(parent, n, None) for n in names]
                if all(isinstance(m, nn.Linear) for m in members):
                    _fuse_int4(parent, names, members, activations)
                    fused.update(id(m) for m in members)
                    for m in members:
                        drop_pages(m.weight, mapped)
                    trim_now_and_then()
        for parent, name, child in targets:
            if id(child) in fused:
                continue
            if parent is model and name == "lm_head":
                _replace_head(model, child, replace, activations)
            else:
                replace(parent, name, Int4WeightOnlyLinear(child, activations=activations), child)
        return len(targets)
    absmax = calibrate_input_absmax(model, [c for _, _, c in targets], calibration_ids, device) if calibration_ids else {}
    for parent, name, child in targets:
        replace(parent, name, Int8Linear(child, absmax.get(id(child))), child)
    return len(targets)


def _replace_head(model: nn.Module, head: nn.Linear, replace: Callable, activations: str = "fp32") -> None:
    """The int4 methods' LM head stays 8-bit: GGUFs keep it (tied to the embeddings) above 4 bits
    (Q8_0 in the bundled one), and in 4 bits SmolLM2's top-1 agreement with fp32 fell to 0.78. With
    Magnitude's kernels, int8 per group of 32 (`Int8GroupLinear`, exact on Q8_0 blocks) and tied
    embeddings read from the same codes; else per output channel for torch's kernel. Its
    activations are fp32, or int16 under w4a16-int16 (`activations` "int16")."""
    kernel = lowbit.kernels()
    if kernel is None:
        replace(model, "lm_head", WeightOnlyInt8Linear(head, torch.bfloat16), head)
        return
    embed = _tied_embedding(model, head)
    quantized = Int8GroupLinear(head, kernel, activations="int16" if activations == "int16" else "fp32")
    replace(model, "lm_head", quantized, head)
    if embed is not None:  # its weight's pages went with the head's
        model.model.embed_tokens = Int8GroupEmbedding(quantized, embed.padding_idx, embed.weight.dtype)


def calibrate_input_absmax(model: nn.Module, linears: list[nn.Linear], ids: list[int],
                  device: torch.device) -> dict[int, torch.Tensor]:
    """Each linear's per-input-channel max |x| over one forward of `ids`."""
    seen: dict[int, torch.Tensor] = {}

    def record(module: nn.Module, inputs: tuple[torch.Tensor, ...], _output: torch.Tensor) -> None:
        x = inputs[0].detach()
        seen[id(module)] = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()

    hooks = [lin.register_forward_hook(record) for lin in linears]
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen
