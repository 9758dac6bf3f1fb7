"""A step's decoder layers in one native call (`magnitude_decode_layers` in lowbit_kernels.c).

The lean forward (paged_decoder.py) still runs about a hundred torch operations per layer; at one to
a few rows each is mostly framework time, and together they were two thirds of a w4a16 decode step
at batch 1 (`bench/step_profile.py`). For a model the lean forward takes (transformers' Llama,
Mistral, Qwen2) with fp32 activations, SiLU, and every projection in w4a16 (or every one in w4a8, or
in w4a16-bf16prefill, whose products take the rows the runner marks in bf16) on
Magnitude's kernels, `fused_decoder` returns a forward that runs all layers in C: RMSNorm, the fused
q/k/v product, RoPE with the model's own cos/sin, the K/V write into the paged pool, grouped-query
attention over each row's blocks (its sliding window, if any), the output projection, the SiLU-gated
MLP, both residuals and the final norm; the pool may hold fp32 or float16 K/V (kvCache.dtype), the
attention summing in fp32 either way. The embeddings and the rotary table stay in torch. It takes
decode steps and steps whose prefill chunks attend to few enough keys (`runs_fused`); a step with
more, where SDPA's block products win, and every other model go through the lean forward.

It computes what the lean forward computes, in another order (its own sums, no SDPA), so its
results agree to fp32 rounding, not bit for bit; tests/runner/test_fused_decode.py bounds the
difference and checks that a row's result does not depend on its batch or the thread count.
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
from magnitude.runner.quantize import Int4Group, Int4WeightOnlyLinear, Int8GroupEmbedding

log = logging.getLogger(__name__)


class _Dims(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                                     "block_size", "table_width")] + \
               [("eps", ctypes.c_float), ("scaling", ctypes.c_float), ("act_int8", ctypes.c_int64),
                ("kv_f16", ctypes.c_int64), ("bf16_rows", ctypes.c_void_p)]


_LAYER_POINTERS = ("in_norm", "post_norm", "qkv_codes", "qkv_scales", "qkv_mins", "qkv_bias", "o_codes", "o_scales",
                   "o_mins", "o_bias", "gu_codes", "gu_scales", "gu_mins", "gu_bias", "down_codes", "down_scales",
                   "down_mins", "down_bias", "k_cache", "v_cache")


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _LAYER_POINTERS] + [("window", ctypes.c_int64)]


@dataclass(frozen=True)
class _Int4:
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bias: torch.Tensor | None
    activations: str  # "fp32" (w4a16), "int8" (w4a8) or "bf16prefill" (w4a16-bf16prefill)


def _native_int4(module: nn.Module | Int4Group | None, kernel: lowbit.LowbitKernels) -> _Int4 | None:
    """The int4 operands of a fused group or a w4a16/w4a8 linear on `kernel`, fp32 bias; else None."""
    linear = module.fused if isinstance(module, Int4Group) else module
    if type(linear) is not Int4WeightOnlyLinear or linear.kernel is not kernel:
        return None
    bias = linear.bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    return _Int4(linear.qweight, linear.scales, linear.mins, bias, linear.activations)


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
# trace's chunks): 78-136k keys 0.78-0.88x, and 64 at 2,000 0.91x this time. So the bound is
# FUSED_MAX_CHUNK_KEYS_BF16, between the 136k that won and the 260k that lost.
FUSED_MAX_CHUNK_ROWS_BF16 = 512
FUSED_MAX_CHUNK_KEYS_BF16 = 150_000
# KV pools the C code reads and writes (kvCache.dtype float32 or float16; attention sums in fp32).
FUSED_POOL_DTYPES = (torch.float32, torch.float16)


def runs_fused(batch: PagedBatch, max_chunk_rows: int = FUSED_MAX_CHUNK_ROWS,
               max_chunk_keys: int = FUSED_MAX_CHUNK_KEYS) -> bool:
    """Whether the fused forward takes this step (see FUSED_MAX_CHUNK_ROWS); decode rows always qualify."""
    rows = batch.num_tokens
    decode_rows = [g.q_index[:, 0] for g in batch.groups if g.q_index.shape[1] == 1]
    chunk_rows = rows - sum(len(r) for r in decode_rows)
    if not chunk_rows:
        return True
    if chunk_rows > max_chunk_rows:
        return False
    keys = int(batch.row_positions.sum()) + rows  # every row attends to its position + 1 keys
    keys -= sum(int(batch.row_positions[r.numpy()].sum()) + len(r) for r in decode_rows)
    return keys <= max_chunk_keys


def fused_decoder(inner: nn.Module, window: Callable[[nn.Module], int | None],
                  choose: Callable[[PagedBatch], bool] = runs_fused) -> DecodeFn | None:
    """The fused forward for `inner` (already accepted by paged_decoder.lean_family, whose
    `window(attn)` gives each layer's sliding window), or None when the model is not one it runs:
    not w4a16 (or not w4a8) on Magnitude's kernels throughout, not fp32, or not SiLU. The forward
    returns the final norm's output, or None for a step `choose` declines (by default
    `runs_fused`, with FUSED_MAX_CHUNK_ROWS_BF16 and FUSED_MAX_CHUNK_KEYS_BF16 under
    w4a16-bf16prefill), for the caller to run the lean forward.

    The weights' addresses are taken now (their tensors kept alive with the forward): a model whose
    modules or buffers are replaced later needs a new forward, as runner.py builds after quantizing."""
    from magnitude.runner.paged_decoder import _fused_group  # paged_decoder imports this module

    config = inner.config
    layers = list(inner.layers[: config.num_hidden_layers])
    if not layers:
        return None
    # The kernels the model's projections were built on (none for an unquantized model, which
    # therefore never builds them); every projection is checked against it below.
    kernel = getattr(layers[0].self_attn.o_proj, "kernel", None)
    embed = inner.embed_tokens
    fp32_rows = (embed.dtype if isinstance(embed, Int8GroupEmbedding) else embed.weight.dtype) == torch.float32
    if not isinstance(kernel, lowbit.LowbitKernels) or getattr(config, "hidden_act", None) != "silu" or not fp32_rows:
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
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _native_int4(_fused_group(attn.q_proj, attn.k_proj, attn.v_proj), kernel)
        gate_up = _native_int4(_fused_group(mlp.gate_proj, mlp.up_proj), kernel)
        o, down = _native_int4(attn.o_proj, kernel), _native_int4(mlp.down_proj, kernel)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if None in (qkv, gate_up, o, down) or any(n.weight.dtype != torch.float32 for n in norms):
            return None
        activations.update(op.activations for op in (qkv, gate_up, o, down))
        if attn.head_dim != head_dim or float(attn.scaling) != float(attn0.scaling):
            return None
        entry: dict[str, int] = {}
        for prefix, op in (("qkv", qkv), ("o", o), ("gu", gate_up), ("down", down)):
            for part in ("codes", "scales", "mins", "bias"):
                t = getattr(op, part)
                entry[f"{prefix}_{part}"] = 0 if t is None else t.data_ptr()
                if t is not None:
                    keep.append(t)
        for name, norm in zip(("in_norm", "post_norm"), norms):
            w = norm.weight.detach().contiguous()
            keep.append(w)
            entry[name] = w.data_ptr()
        weights.append(entry)
        windows.append(window(attn) or 0)
    eps = {float(n.variance_epsilon) for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)}
    if len(eps) != 1 or len(activations) != 1 or inner.norm.weight.dtype != torch.float32:
        return None
    kind = activations.pop()  # one kind throughout (checked above)
    final_norm = inner.norm.weight.detach().contiguous()
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
                act_int8=int(kind == "int8"))
    bf16prefill = kind == "bf16prefill"  # its products read the step's marked rows
    if bf16prefill and choose is runs_fused:
        choose = functools.partial(runs_fused, max_chunk_rows=FUSED_MAX_CHUNK_ROWS_BF16,
                                   max_chunk_keys=FUSED_MAX_CHUNK_KEYS_BF16)
    rope = _RopeTable(inner.rotary_emb)

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, batch: PagedBatch) -> torch.Tensor | None:
        if not choose(batch):
            return None
        pool = batch.k_layers
        caches = (*pool[: len(layers)], *batch.v_layers[: len(layers)])
        if len(pool) < len(layers) or pool[0].dtype not in FUSED_POOL_DTYPES \
                or any(t.dtype != pool[0].dtype or not t.is_contiguous() for t in caches):
            return None
        tables = np.ascontiguousarray(batch.row_tables, dtype=np.int64)
        positions = np.ascontiguousarray(batch.row_positions, dtype=np.int64)
        # The C code indexes the pool with these unchecked, where torch's index ops would raise.
        blocks = pool[0].shape[0] // batch.block_size
        if tables.size and (tables.min() < 0 or tables.max() >= blocks or positions.min() < 0
                            or positions.max() // batch.block_size >= tables.shape[1]):
            raise ValueError(f"fused step: a block id outside the pool's {blocks} blocks or a position past its table")
        h = inner.embed_tokens(input_ids)[0].contiguous()  # [T, hidden], fresh: updated in place
        cos, sin = rope.rows(h, position_ids)  # [T, head_dim]
        if cos.shape[-1] != head_dim:  # partial rotary: not something these families do
            return None
        for i in range(len(layers)):
            table[i].k_cache = pool[i].data_ptr()
            table[i].v_cache = batch.v_layers[i].data_ptr()
        marked = lowbit.current_bf16_rows(h.shape[0]) if bf16prefill else None
        d = _Dims(block_size=batch.block_size, table_width=tables.shape[1], kv_f16=int(pool[0].dtype == torch.float16),
                  bf16_rows=None if marked is None else marked.ctypes.data, **dims)
        rc = lib.magnitude_decode_layers(ctypes.byref(d), table, len(layers), h.data_ptr(), h.shape[0],
                                         positions.ctypes.data, tables.ctypes.data, cos.data_ptr(), sin.data_ptr(),
                                         final_norm.data_ptr(), final_eps, torch.get_num_threads())
        if rc != 0:  # nothing was written: the lean forward runs the step
            log.warning("fused step declined (%s); this step runs the lean forward",
                        "out of memory" if rc == -1 else "a shape it does not take")
            return None
        return h

    forward.keep = keep  # type: ignore[attr-defined]
    forward.choose = choose  # type: ignore[attr-defined]  # which steps it takes (tests read it)
    return forward
