"""A step's decoder layers in one native call (`magnitude_decode_layers` in lowbit_kernels.c).

The lean forward (paged_decoder.py) still runs about a hundred torch operations per layer; at one to
a few rows each is mostly framework time, and together they were two thirds of a w4a16 decode step
at batch 1 (`bench/step_profile.py`). For a model the lean forward takes (transformers' Llama,
Mistral, Qwen2) with SiLU, and either fp32 activations with every projection in w4a16 (or every one
in w4a8, or in w4a16-bf16prefill, whose products take the rows the runner marks in bf16) on
Magnitude's kernels, or bfloat16 weights throughout (every projection a plain bf16 linear, on
Magnitude's kernels built for this process with AVX2 or AVX-512), `fused_decoder` returns a forward that runs all layers
in C: RMSNorm, the q/k/v product, RoPE with the model's own cos/sin, the K/V write into the paged
pool, grouped-query attention over each row's blocks (its sliding window, if any), the output
projection, the SiLU-gated MLP, both residuals and the final norm; the pool may hold fp32 or float16
K/V (kvCache.dtype), the attention summing in fp32 either way. The embeddings and the rotary table
stay in torch. It takes decode steps and steps whose prefill chunks are short and attend to few
enough keys (`runs_fused`); a step with more, where SDPA's block products (and a bf16 model's
oneDNN products) win, and every other model go through the lean forward.

For w4a16/w4a8 it computes what the lean forward computes, in another order (its own sums, no SDPA),
so its results agree to fp32 rounding, not bit for bit. A bf16 model's step runs in fp32 on its bf16
weights (widened exactly), norms and RoPE: what the lean forward computes for the same model in
fp32, to fp32 rounding, where torch's bf16 forward rounds every activation to bf16 (about 2e-2 away
on the tiny test models); it returns the hidden states in bf16 for the model's LM head.
tests/runner/test_fused_decode.py bounds the differences and checks that a row's result does not
depend on its batch or the thread count.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from magnitude.runner import lowbit
from magnitude.runner.attention import PagedBatch
from magnitude.runner.quantize import (PROMPT_ROW_ACTIVATIONS, Int4FusedMember, Int4Group, Int4WeightOnlyLinear,
                                       Int8GroupEmbedding)

log = logging.getLogger(__name__)


class _Dims(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                                     "block_size", "table_width")] + \
               [("eps", ctypes.c_float), ("scaling", ctypes.c_float), ("act_int8", ctypes.c_int64),
                ("kv_f16", ctypes.c_int64), ("prompt_rows", ctypes.c_void_p), ("dense_bf16", ctypes.c_int64)]


_LAYER_POINTERS = ("in_norm", "post_norm", "qkv_codes", "qkv_scales", "qkv_mins", "qkv_bias", "o_codes", "o_scales",
                   "o_mins", "o_bias", "gu_codes", "gu_scales", "gu_mins", "gu_bias", "down_codes", "down_scales",
                   "down_mins", "down_bias", "k_cache", "v_cache")


_DENSE_POINTERS = ("q_w", "k_w", "v_w", "o_w", "gate_w", "up_w", "down_w")


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _LAYER_POINTERS] + [("window", ctypes.c_int64)] + \
               [(name, ctypes.c_void_p) for name in _DENSE_POINTERS]


@dataclass(frozen=True)
class _Int4:
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bias: torch.Tensor | None
    activations: str  # "fp32" (w4a16), "int8" (w4a8), "int16" (w4a16-int16) or "bf16prefill" (w4a16-bf16prefill)


def _native_int4(module: nn.Module | Int4Group | None, kernel: lowbit.LowbitKernels) -> _Int4 | None:
    """The int4 operands of a fused group or a w4a16/w4a8 linear on `kernel`, fp32 bias; else None."""
    linear = module.fused if isinstance(module, Int4Group) else module
    if type(linear) is not Int4WeightOnlyLinear or linear.kernel is not kernel:
        return None
    bias = linear.bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    return _Int4(linear.qweight, linear.scales, linear.mins, bias, linear.activations)


def _dense_bf16(linear: nn.Module) -> torch.Tensor | None:
    """The weight of a plain bf16 nn.Linear on the CPU, [out, in] contiguous; else None."""
    if type(linear) is not nn.Linear:
        return None
    w = linear.weight
    return w if w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous() else None


def _fp32_bias(*members: nn.Module) -> torch.Tensor | None:
    """The members' biases stacked in fp32 (zeros for a member without one), or None when none has one."""
    if all(m.bias is None for m in members):
        return None
    return torch.cat([m.bias.detach().float() if m.bias is not None else torch.zeros(m.weight.shape[0])
                      for m in members]).contiguous()


def _dense_layer(layer: nn.Module) -> dict[str, torch.Tensor | None] | None:
    """A layer's operands for the C code's bf16 products (dims.dense_bf16): every projection a plain
    bf16 nn.Linear; the biases in fp32, q/k/v's and gate/up's stacked as the C code stacks the
    products. None when a projection is anything else."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = dict(q_w=attn.q_proj, k_w=attn.k_proj, v_w=attn.v_proj, o_w=attn.o_proj, gate_w=mlp.gate_proj,
                   up_w=mlp.up_proj, down_w=mlp.down_proj)
    weights = {name: _dense_bf16(linear) for name, linear in linears.items()}
    if any(w is None for w in weights.values()):
        return None
    return {**weights, "qkv_bias": _fp32_bias(attn.q_proj, attn.k_proj, attn.v_proj), "o_bias": _fp32_bias(attn.o_proj),
            "gu_bias": _fp32_bias(mlp.gate_proj, mlp.up_proj), "down_bias": _fp32_bias(mlp.down_proj)}


def _fused_group(*members: nn.Module) -> Int4Group | None:
    """The w4a16/w4a8 group whose product is exactly `members`, in this order (quantize.py fuses q/k/v
    and gate/up), or None: each member is then called as a module."""
    group = getattr(members[0], "fused_group", None)
    if group is None or len(group.sizes) != len(members):
        return None
    ok = all(isinstance(m, Int4FusedMember) and m.fused_group is group and m.index == i for i, m in enumerate(members))
    return group if ok else None


def _int4_layer(layer: nn.Module, kernel: lowbit.LowbitKernels) -> tuple[dict[str, torch.Tensor | None], str] | None:
    """A layer's int4 operands (fused q/k/v and gate/up groups, o and down) on `kernel` and their
    activation kind, or None when a projection is not w4a16/w4a8 on it or the kinds differ."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = _native_int4(_fused_group(attn.q_proj, attn.k_proj, attn.v_proj), kernel)
    gate_up = _native_int4(_fused_group(mlp.gate_proj, mlp.up_proj), kernel)
    o, down = _native_int4(attn.o_proj, kernel), _native_int4(mlp.down_proj, kernel)
    if qkv is None or gate_up is None or o is None or down is None:
        return None
    kinds = {op.activations for op in (qkv, gate_up, o, down)}
    if len(kinds) != 1:
        return None
    return {f"{prefix}_{part}": getattr(op, part) for prefix, op in (("qkv", qkv), ("o", o), ("gu", gate_up), ("down", down))
            for part in ("codes", "scales", "mins", "bias")}, kinds.pop()


DecodeFn = Callable[[torch.Tensor, torch.Tensor, PagedBatch], "torch.Tensor | None"]

# RoPE types whose frequencies are fixed at load (transformers' "dynamic" and "longrope" rescale
# them with the sequence length): their cos/sin rows depend on the position alone.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class _RopeTable:
    """cos/sin rows by position. For a static RoPE type, computed once by the model's own rotary
    module over positions 0..n-1 (grown by doubling) and indexed per step: each element is
    position x frequency then cos/sin, elementwise, so a row is the one the module would give for
    that position alone, without its ~0.2 ms of framework work per step. Other types call the
    module every step."""

    def __init__(self, rotary: nn.Module) -> None:
        self.rotary = rotary
        self.static = isinstance(getattr(rotary, "rope_type", None), str) and rotary.rope_type in STATIC_ROPE_TYPES
        self.cos = self.sin = torch.empty(0)

    def rows(self, h: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, head_dim] for the step's positions ([1, T])."""
        if not self.static:
            cos, sin = self.rotary(h, position_ids=position_ids)
            return cos[0].contiguous(), sin[0].contiguous()
        need = int(position_ids.max()) + 1
        if need > self.cos.shape[0]:
            # doubling, capped at the model's own context until a position is past it
            grown = max(2 * self.cos.shape[0], 1024)
            limit = getattr(self.rotary, "max_seq_len_cached", None) or grown
            n = max(need, grown if need > limit else min(grown, limit))
            cos, sin = self.rotary(h[:1], position_ids=torch.arange(n, device=h.device)[None])
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        index = position_ids[0]
        return self.cos[index], self.sin[index]


# Which steps run fused. Its products beat the lean forward's on chunks of up to 64 rows, and on
# decode rows at any count; its attention (a pool block at a time for all of a chunk's rows and a
# row's heads) beats SDPA on chunks until they attend to many keys in all, where SDPA's block
# products win. Fused against lean, wall time, two runs on a shared host (`bench/step_profile.py
# --compare-decoders --quantization w4a16 --threads 2 --prefills 16@650,16@1500,16@6000,64,64@1000,64@2000,64@4000`,
# AVX2 EPYC): chunks of 16 tokens at 650, 1,500 and 6,000 (10k, 24k and 96k keys in all) 0.64x,
# 0.79x and 0.82x; a lone 64-token chunk 0.73x; 64 tokens at 1,000 (66k) 0.94x and 1.13x, at 2,000
# (130k) 0.92x and 1.12x, at 4,000 (260k) 1.40x; decodes at any context 0.3-0.5x. On two AVX-512
# EPYC cores (`--batches 24,64 --contexts 200 --prefills 16+48,32+32,16+64,32+64,48+64,16+128,64+16
# --steps 9`, D+N: D decodes beside an N-token chunk), fused against lean: 24 and 64 decodes 0.59x
# and 0.57x, 32+32 0.66x, 16+64 0.78x, 64+16 0.70x, 48+64 0.96x, 32+64 1.03x, 16+48 1.00x, 16+128
# 1.13x; and chunks alone of 96, 128 and 256 rows 1.27x, 1.39x and 1.35x. So the bound is on a
# step's chunk rows, not all its rows (it was 64 rows in all, which sent 64+16 and 96 decodes to
# the lean forward at 1.4x the time, and split the start-up table's cells between the two forwards
# along d + p = 64, where the cost model's interpolation cannot follow): a step runs fused when its
# prefill rows are at most FUSED_MAX_CHUNK_ROWS and attend to at most FUSED_MAX_CHUNK_KEYS keys
# together. The key bound is set by the 64-row chunks, so it is conservative for short ones (16 rows
# at 96k keys still won), and it counts every key before a row's position even under a sliding window.
FUSED_MAX_CHUNK_ROWS = 64
FUSED_MAX_CHUNK_KEYS = 64_000
# Those were measured before a chunk's int4 products converted each weight once for up to 64 rows
# (lowbit_kernels.c, int4_blocked_rows: 0.64-0.69x of the products' time at 64 rows on AVX2, 0.82-0.87x
# on AVX-512, the same bits: bench/int4_product_ab.py) and before a chunk's rows read a float16 pool widened once per run
# (DEFINE_ATTEND_AVX2); both forwards multiply on those kernels, and the fused step's attention now
# wins further. Fused against lean under w4a16, wall time (`bench/step_profile.py --compare-decoders
# --quantization w4a16 --threads 2 --batches 3 --contexts 100 --prefills ...`, 2026-12-06, an AMX
# Xeon, bench/results/runner_llama.md S50): with the kernels built for AVX2 only (an AVX2 CPU's
# build; CC adding -mno-avx512f, torch held to AVX2) chunks alone of 64 / 128 / 256 / 512 rows 0.64x /
# 0.78x / 0.85x / 0.93x, 64 at 1,000 0.78x, 256 at 500 (161k keys) 0.83x, 3 decodes beside 100 at
# 1,300 0.74x, 128 at 2,000 (264k) 0.83x, 256 at 1,000 (289k) 0.92x; the AVX-512 build: 128 rows
# 0.84x, 512 0.97x, 64 at 1,000 0.78x, 3+100 at 1,300 0.78x, 64 at 4,000 0.75x, but 128 at 2,000
# 1.06x and 256 at 1,000 1.15x. So w4a16's bounds are FUSED_MAX_CHUNK_ROWS_W4A16 rows and
# FUSED_MAX_CHUNK_KEYS_W4A16 keys, under every cell that lost; w4a8's products (int8 activations)
# are not blocked and keep the bounds above.
FUSED_MAX_CHUNK_ROWS_W4A16 = 512
FUSED_MAX_CHUNK_KEYS_W4A16 = 150_000
# That AVX2 build was a proxy on an AMX Xeon's memory and caches. On a real AVX2-only CPU (two AMD
# EPYC Zen 3 cores, 2026-12-06, bench/results/runner_llama.md S52; the first command above with
# `--prefills 64,128,256,512,64@1000,256@500,3+100@1300,128@2000,256@1000 --steps 7`, then
# `--prefills 128,256,384,512,3+256@200`), fused against lean: 3 decodes 0.39x and 0.38x, a chunk of
# 64 rows 0.91x, 64 at 1,000 0.99x, 3 decodes beside 100 at 1,300 0.89x, but chunks of 128 rows
# 1.02x and 1.07x, 256 0.96x and 1.10x, 384 1.07x, 512 1.12x and 1.02x, 3 beside 256 at 200 1.01x.
# So on the AVX2 build w4a16's chunks run fused up to FUSED_MAX_CHUNK_ROWS_W4A16_AVX2 rows, where
# the two forwards meet, under the same key bound.
FUSED_MAX_CHUNK_ROWS_W4A16_AVX2 = 128
# With w4a16-bf16prefill's bf16 products a chunk's products are about 3x cheaper in both forwards,
# and the fused step beats the lean forward at every chunk size measured, and up to about twice the
# keys. Fused against lean, two AVX-512 BF16 EPYC cores (`bench/step_profile.py
# --compare-decoders --quantization w4a16-bf16prefill --threads 2 --batches 24 --contexts 200
# --prefills 16+64,16+96,16+128,96,128,256,64@1000 --steps 7`, then `--prefills 64@2000,64@4000,
# 128@2000,256@1000,512,16+256@500 --steps 5`): 16+96 0.77x, 16+128 0.79x, chunks alone of 96, 128,
# 256 and 512 rows 0.83x, 0.86x, 0.86x, 0.89x, 16+256 at 500 0.90x; 64 at 1,000 0.92x, but 64 at
# 2,000 1.08x, 64 at 4,000 1.16x, 128 at 2,000 1.14x and 256 at 1,000 1.05x. Then beside 2-4
# decodes at context 100 (`--batches 3 --contexts 100 --prefills 3+83@940,2+95@641,4+78@1080,
# 4+128@1000` and `3+32@3000,3+64@1500,3+48@2500,3+100@1300,3+64@2000 --steps 5`, the long
# trace's chunks): 78-136k keys 0.78-0.88x, and 64 at 2,000 0.91x this time. So the bound was
# 150k keys, between the 136k that won and the 260k that lost, and stays that over an fp32 pool
# (an explicit kvCache.dtype float32: FUSED_MAX_CHUNK_KEYS_BF16_FP32_POOL). Over a float16 pool,
# the default beside these weights, a chunk's rows now read each block segment widened to fp32
# once per 16-row run and query head, not at every read (lowbit_kernels.c, DEFINE_ATTEND_AVX2):
# deep chunks' fused steps 0.79-0.83x (bench/kernel_ab.py). Fused against lean then, two AMX Xeon
# cores (same command, `--batches 3 --contexts 100 --prefills 64@1000,64@2000,64@4000,128@2000,
# 256@500,256@1000,3+100@1300` and others, four runs, 2026-12-05, bench/results/runner_llama.md
# S49-A): 64 at 1,000 0.50-0.52x, at 2,000 0.65-0.81x, at 4,000 (258k keys) 0.67-0.84x, 128 at
# 2,000 (264k) 0.70-1.01x, 256 at 500 (161k) 0.86-0.93x, 3 decodes beside 100 at 1,300
# 0.69-0.76x, but 256 at 1,000 (289k) 1.12-1.18x and at 2,000 1.37x (with many rows torch's
# attention products gain more than the fused step's per-row loops). So over a float16 pool the
# bound is FUSED_MAX_CHUNK_KEYS_BF16, past the 264k that was not slower and under the 289k that was.
FUSED_MAX_CHUNK_ROWS_BF16 = 512
FUSED_MAX_CHUNK_KEYS_BF16 = 270_000
FUSED_MAX_CHUNK_KEYS_BF16_FP32_POOL = 150_000
# KV pools the C code reads and writes (kvCache.dtype float32 or float16; attention sums in fp32).
FUSED_POOL_DTYPES = (torch.float32, torch.float16)


FUSED_BOUNDS_W4A16 = dict(max_chunk_rows=FUSED_MAX_CHUNK_ROWS_W4A16, max_chunk_keys=FUSED_MAX_CHUNK_KEYS_W4A16)
FUSED_BOUNDS_W4A16_AVX2 = dict(max_chunk_rows=FUSED_MAX_CHUNK_ROWS_W4A16_AVX2, max_chunk_keys=FUSED_MAX_CHUNK_KEYS_W4A16)
FUSED_BOUNDS_BF16PREFILL = dict(max_chunk_rows=FUSED_MAX_CHUNK_ROWS_BF16, max_chunk_keys=FUSED_MAX_CHUNK_KEYS_BF16)
FUSED_BOUNDS_BF16PREFILL_FP32_POOL = dict(max_chunk_rows=FUSED_MAX_CHUNK_ROWS_BF16,
                                          max_chunk_keys=FUSED_MAX_CHUNK_KEYS_BF16_FP32_POOL)
# A bf16 model's products in the C code widen its weights to fp32 in registers and sum in fp32 FMAs,
# where torch's bf16 products (oneDNN: AVX512-BF16 dot products, AMX tiles) take a chunk's many rows at
# a fraction of the cost and its per-call work is what a few rows pay. Fused against lean, wall time,
# two AMX Xeon cores (`bench/step_profile.py --compare-decoders --dtype bfloat16 --quantization none
# --threads 2`, 2026-12-05): decodes at context 100 0.37x / 0.35x / 0.39x / 0.46x / 0.57x at batch 1 / 2 /
# 4 / 8 / 16 (16.6 against 45.1 ms at batch 1), at context 1,000 0.32-0.37x, at context 200 0.56x /
# 0.56x / 0.66x / 0.67x / 0.73x at 24 / 32 / 64 / 96 / 128; chunks alone of 8 / 16 / 32 rows 0.52x /
# 0.61x / 0.83x, of 48 / 64 / 128 1.18x / 1.04x / 1.63x; beside decodes 24+32 0.83x, 32+32 0.77x,
# 48+16 0.71x, 16+48 0.81x, 8+56 0.79x (the lean forward's decode rows cost it most). So decode rows
# always qualify and chunk rows up to FUSED_MAX_CHUNK_ROWS_DENSE_BF16. Where bf16 is not native (AVX2,
# AVX-512 without BF16) torch's bf16 products cost more and the bound is the safer for it.
FUSED_MAX_CHUNK_ROWS_DENSE_BF16 = 32
FUSED_BOUNDS_DENSE_BF16 = dict(max_chunk_rows=FUSED_MAX_CHUNK_ROWS_DENSE_BF16)
# The portable build (lowbit isa "generic": no AVX2, what an older x86 or a non-x86 CPU compiles)
# attends in plain C, where torch's attention still has its vectors, so every bound above (measured
# on AVX2 and AVX-512 builds) admits steps it loses. Fused against lean under w4a16, a proxy on an
# AVX-512 EPYC (the kernels built with -mno-avx2 -mno-avx512f -mno-fma added, torch held to
# ATEN_CPU_CAPABILITY=default; `bench/step_profile.py --compare-decoders --dtype float32
# --quantization w4a16 --threads 2 --batches 3 --contexts 100 --prefills 64,128,256,64@1000,3+100@1300
# --steps 5`, 2026-12-06, bench/results/runner_llama.md S51): 3 decodes at 100 0.87x; chunks of 64,
# 128 and 256 rows from position 0 1.01x, 1.04x and 1.06x; 64 at 1,000 1.78x and 3 decodes beside
# 100 at 1,300 2.21x. So there a step runs fused only when it has no chunk rows.
FUSED_BOUNDS_PORTABLE = dict(max_chunk_rows=0)


def runs_fused(batch: PagedBatch, max_chunk_rows: int = FUSED_MAX_CHUNK_ROWS,
               max_chunk_keys: int = FUSED_MAX_CHUNK_KEYS) -> bool:
    """Whether the fused forward takes this step (see FUSED_MAX_CHUNK_ROWS); decode rows always qualify."""
    chunk_rows = batch.num_tokens - batch.decode_rows
    if not chunk_rows:
        return True
    if chunk_rows > max_chunk_rows:
        return False
    # A chunk's row at position p attends to p + 1 keys: n rows from `start` read n * start + n(n+1)/2.
    keys = sum(s.n * s.start + s.n * (s.n + 1) // 2 for s in batch.seqs if s.n > 1)
    return keys <= max_chunk_keys


def runs_fused_bf16prefill(batch: PagedBatch) -> bool:
    """runs_fused with w4a16-bf16prefill's bounds for the step's pool: FUSED_BOUNDS_BF16PREFILL over
    a float16 one, FUSED_BOUNDS_BF16PREFILL_FP32_POOL over an fp32 one."""
    float16 = bool(batch.k_layers) and batch.k_layers[0].dtype == torch.float16
    return runs_fused(batch, **(FUSED_BOUNDS_BF16PREFILL if float16 else FUSED_BOUNDS_BF16PREFILL_FP32_POOL))


def fused_decoder(inner: nn.Module, window: Callable[[nn.Module], int | None],
                  choose: Callable[[PagedBatch], bool] = runs_fused) -> DecodeFn | None:
    """The fused forward for `inner` (already accepted by paged_decoder.lean_family, whose
    `window(attn)` gives each layer's sliding window), or None when the model is not one it runs:
    not SiLU, or neither fp32 with w4a16 (or w4a8) on Magnitude's kernels throughout nor bf16
    throughout on the CPU with the kernels built for AVX2 or AVX-512 (not where
    MAGNITUDE_LOWBIT_KERNEL=torch, the build failed or took the portable path). The forward returns the final norm's output in the model's dtype, or None for a
    step `choose` declines (by default `runs_fused` with FUSED_BOUNDS_PORTABLE on the portable build,
    else under w4a16 FUSED_BOUNDS_W4A16 (FUSED_BOUNDS_W4A16_AVX2 on the AVX2 build), its own bounds under w4a8, runs_fused_bf16prefill under w4a16-bf16prefill and FUSED_BOUNDS_DENSE_BF16 for a bf16
    model), for the caller to run the lean
    forward.

    The weights' addresses are taken now (their tensors kept alive with the forward): a model whose
    modules or buffers are replaced later needs a new forward, as runner.py builds after quantizing."""
    config = inner.config
    layers = list(inner.layers[: config.num_hidden_layers])
    if not layers or getattr(config, "hidden_act", None) != "silu":
        return None
    embed = inner.embed_tokens
    rows_dtype = embed.dtype if isinstance(embed, Int8GroupEmbedding) else embed.weight.dtype
    # bf16 projections (every layer's, checked first: a model that is not one never builds the
    # kernels) run on this process's kernels, built at first use; none where torch's kernels are
    # chosen or the build failed, and the portable build has no bf16 products (they are vectorised
    # only): the lean forward then runs every step. int4 ones run on the
    # kernels they were built on (none for an unquantized model, which therefore never builds them).
    dense_layers = [_dense_layer(layer) for layer in layers] \
        if type(embed) is nn.Embedding and rows_dtype == torch.bfloat16 else []
    dense = bool(dense_layers) and all(operands is not None for operands in dense_layers)
    kernel = lowbit.kernels() if dense else getattr(layers[0].self_attn.o_proj, "kernel", None)
    if not isinstance(kernel, lowbit.LowbitKernels) or (rows_dtype != torch.float32 and not dense) \
            or (dense and kernel.isa == "generic"):
        return None
    attn0 = layers[0].self_attn
    heads, head_dim = config.num_attention_heads, attn0.head_dim
    kv_heads = config.num_key_value_heads
    if head_dim > 512 or head_dim % 2 or heads % kv_heads:
        return None
    keep: list[torch.Tensor] = []  # every tensor a pointer is taken from, alive as long as the forward
    weights: list[dict[str, int]] = []
    activations: set[str] = set()  # one kind throughout: the C code takes one flag for every product
    windows: list[int] = []
    norm_dtypes = (torch.float32, torch.bfloat16) if dense else (torch.float32,)
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if dense:
            operands, kind = dense_layers[i], "dense_bf16"
        else:
            operands, kind = _int4_layer(layer, kernel) or (None, "")
        if operands is None or any(n.weight.dtype not in norm_dtypes for n in norms):
            return None
        activations.add(kind)
        if attn.head_dim != head_dim or float(attn.scaling) != float(attn0.scaling):
            return None
        # norms in fp32 (a bf16 model's widened: exact), as the C code reads them
        operands.update(in_norm=norms[0].weight.detach().float().contiguous(),
                        post_norm=norms[1].weight.detach().float().contiguous())
        keep.extend(t for t in operands.values() if t is not None)
        weights.append({name: 0 if t is None else t.data_ptr() for name, t in operands.items()})
        windows.append(window(attn) or 0)
    eps = {float(n.variance_epsilon) for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)}
    if len(eps) != 1 or len(activations) != 1 or inner.norm.weight.dtype not in norm_dtypes:
        return None
    kind = activations.pop()  # one kind throughout (checked above)
    final_norm = inner.norm.weight.detach().float().contiguous()
    keep.append(final_norm)
    final_eps = float(inner.norm.variance_epsilon)
    lib = kernel.lib
    table = (_Layer * len(layers))()
    for i, (entry, win) in enumerate(zip(weights, windows)):
        for name, ptr in entry.items():
            setattr(table[i], name, ptr)
        table[i].window = win
    dims = dict(hidden=config.hidden_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                intermediate=config.intermediate_size, eps=eps.pop(), scaling=float(attn0.scaling),
                act_int8={"int8": 1, "int16": 2}.get(kind, 0), dense_bf16=int(dense))
    bf16prefill = kind == "bf16prefill"
    marks_prompt_rows = kind in PROMPT_ROW_ACTIVATIONS  # their products read the step's marked rows
    if choose is runs_fused and kernel.isa == "generic":  # int4 products only: dense needs vectors (above)
        choose = functools.partial(runs_fused, **FUSED_BOUNDS_PORTABLE)
    elif choose is runs_fused and kind in ("fp32", "int16"):  # w4a16, and w4a16-int16 whose chunks are w4a16's
        choose = functools.partial(runs_fused, **(FUSED_BOUNDS_W4A16_AVX2 if kernel.isa == "avx2" else FUSED_BOUNDS_W4A16))
    elif choose is runs_fused and (bf16prefill or dense):
        choose = functools.partial(runs_fused, **FUSED_BOUNDS_DENSE_BF16) if dense else runs_fused_bf16prefill
    rope = _RopeTable(inner.rotary_emb)
    # The pool the layer table points at, as (its tensors' addresses, dtype, shape): a step over the
    # same pool (every step of a runner) neither checks nor points the table again.
    pointed: list[tuple] = [()]

    def point_at(pool: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Point the layer table at the pool's K/V tensors; False for a pool the C code cannot read."""
        caches = (*pool[: len(layers)], *values[: len(layers)])
        if len(pool) < len(layers) or len(values) < len(layers):
            return False
        key = (tuple(t.data_ptr() for t in caches), pool[0].dtype, tuple(pool[0].shape))
        if key == pointed[0]:
            return True
        if pool[0].dtype not in FUSED_POOL_DTYPES \
                or any(t.dtype != pool[0].dtype or t.shape != pool[0].shape or not t.is_contiguous() for t in caches):
            return False
        for i in range(len(layers)):
            table[i].k_cache = pool[i].data_ptr()
            table[i].v_cache = values[i].data_ptr()
        pointed[0] = key
        return True

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, batch: PagedBatch) -> torch.Tensor | None:
        if not choose(batch):
            return None
        pool = batch.k_layers
        if not point_at(pool, batch.v_layers):
            return None
        tables = np.ascontiguousarray(batch.row_tables, dtype=np.int64)
        positions = np.ascontiguousarray(batch.row_positions, dtype=np.int64)
        # The C code indexes the pool with these unchecked, where torch's index ops would raise.
        blocks = pool[0].shape[0] // batch.block_size
        if tables.size and (tables.min() < 0 or tables.max() >= blocks or positions.min() < 0
                            or positions.max() // batch.block_size >= tables.shape[1]):
            raise ValueError(f"fused step: a block id outside the pool's {blocks} blocks or a position past its table")
        h = inner.embed_tokens(input_ids)[0].to(torch.float32).contiguous()  # [T, hidden], fresh: updated in place
        cos, sin = rope.rows(h, position_ids)  # [T, head_dim]
        if cos.shape[-1] != head_dim:  # partial rotary: not something these families do
            return None
        marked = lowbit.current_prompt_rows(h.shape[0]) if marks_prompt_rows else None
        d = _Dims(block_size=batch.block_size, table_width=tables.shape[1], kv_f16=int(pool[0].dtype == torch.float16),
                  prompt_rows=None if marked is None else marked.ctypes.data, **dims)
        rc = lib.magnitude_decode_layers(ctypes.byref(d), table, len(layers), h.data_ptr(), h.shape[0],
                                         positions.ctypes.data, tables.ctypes.data, cos.data_ptr(), sin.data_ptr(),
                                         final_norm.data_ptr(), final_eps, torch.get_num_threads())
        if rc != 0:  # nothing was written: the lean forward runs the step
            log.warning("fused step declined (%s); this step runs the lean forward",
                        "out of memory" if rc == -1 else "a shape it does not take")
            return None
        return h.to(rows_dtype)  # what the model's LM head takes (a bf16 model's)

    forward.keep = keep  # type: ignore[attr-defined]
    forward.choose = choose  # type: ignore[attr-defined]  # which steps it takes (tests read it)
    return forward
