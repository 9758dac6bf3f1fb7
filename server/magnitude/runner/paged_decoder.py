"""How the runner runs a decoder over one step's paged batch: `paged_decoder(inner)` returns the
function (input_ids [1, T], position_ids [1, T], PagedBatch) -> last hidden state [T, hidden].

For transformers' Llama classes (SmolLM2, Llama 2/3, and every checkpoint that loads as them) it is
a lean forward: the same modules and the same tensor operations in the same order as transformers'
own forward, so its output is the same bit for bit (tests/runner/test_paged_decoder.py checks it on
the CPU for fp32, bf16, w4a16, w8a16 and w8a8), without the per-call framework work around them
(decorators, output capture, keyword plumbing, module calls for layers, attention, MLP and norms).
At one decode per step that work was about a seventh of the step (`bench/step_profile.py
--compare-decoders`). Two reorderings stay exact: RoPE's rotate-half is a roll times a sign-folded
sine (negation is exact), and with fused w4a16 projections the queries and keys, adjacent in the
q/k/v product, are rotated in one pass (the rotation is element-wise). Residual additions are done
in place (the embedding lookup returns fresh rows).

Because the layers, attention, MLP and norm modules are not called as modules, forward hooks on
them do not fire here (the projections are still module calls). Nothing in the engine hooks them;
code that does (quantization's calibration pass) calls the model itself.

Any other architecture, a Llama whose modules are not transformers' own classes, or one set to
another attention implementation runs through transformers' forward."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama as llama

from magnitude.runner.attention import ATTN_IMPLEMENTATION, PagedBatch
from magnitude.runner.quantize import Int4FusedMember, Int4Group

DecoderFn = Callable[[torch.Tensor, torch.Tensor, PagedBatch], torch.Tensor]


def paged_decoder(inner: nn.Module) -> DecoderFn:
    """The forward for `inner` (a causal LM's `.model`): lean for transformers' Llama, its own otherwise."""
    if is_plain_llama(inner):
        return lambda input_ids, position_ids, batch: llama_forward(inner, input_ids, position_ids, batch)

    def transformers_forward(input_ids: torch.Tensor, position_ids: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        return inner(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                     magnitude_batch=batch).last_hidden_state[0]

    return transformers_forward


def is_plain_llama(inner: nn.Module) -> bool:
    """True when every module the lean forward stands in for is transformers' Llama class itself
    (a subclass may change any step, so it is not taken for one) and the model attends through the
    paged attention (the lean forward calls it whatever the config says)."""
    if type(inner) is not llama.LlamaModel or type(inner.embed_tokens) is not nn.Embedding:
        return False
    if getattr(inner.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return False
    if type(inner.norm) is not llama.LlamaRMSNorm or type(inner.rotary_emb) is not llama.LlamaRotaryEmbedding:
        return False
    return all(
        type(layer) is llama.LlamaDecoderLayer and type(layer.self_attn) is llama.LlamaAttention
        and type(layer.mlp) is llama.LlamaMLP and type(layer.input_layernorm) is llama.LlamaRMSNorm
        and type(layer.post_attention_layernorm) is llama.LlamaRMSNorm
        for layer in inner.layers
    )


def _rms_norm(norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm.forward, operation for operation."""
    dtype = h.dtype
    x = h.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, half: int) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x, half) * sin_signed."""
    return (x * cos) + (x.roll(half, dims=-1) * sin_signed)


def _fused_group(*members: nn.Module) -> Int4Group | None:
    """The w4a16 group whose product is exactly `members`, in this order (quantize.py fuses q/k/v
    and gate/up), or None: each member is then called as a module."""
    group = getattr(members[0], "fused_group", None)
    if group is None or len(group.sizes) != len(members):
        return None
    ok = all(isinstance(m, Int4FusedMember) and m.fused_group is group and m.index == i for i, m in enumerate(members))
    return group if ok else None


def llama_forward(inner: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  batch: PagedBatch) -> torch.Tensor:
    """LlamaModel.forward over the paged batch (no cache object, no mask: the paged attention
    builds its own), returning the final-norm hidden state of every row, [T, hidden]."""
    attend = ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]  # looked up per call, as transformers does: profilers wrap it
    h = inner.embed_tokens(input_ids)[0]  # [T, hidden], a fresh tensor: the residual is added in place
    cos, sin = inner.rotary_emb(h, position_ids=position_ids)
    cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, head_dim], broadcast over heads
    half = cos.shape[-1] // 2
    sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    tokens = h.shape[0]
    for layer in inner.layers[: inner.config.num_hidden_layers]:
        attn = layer.self_attn
        head_dim = attn.head_dim
        x = _rms_norm(layer.input_layernorm, h)
        group = _fused_group(attn.q_proj, attn.k_proj, attn.v_proj)
        if group is not None:
            qkv = group.fused(x)
            nq, nk = group.sizes[0], group.sizes[1]
            qk = _rotate(qkv[:, : nq + nk].view(tokens, -1, head_dim), cos, sin_signed, half)
            q, k = qk[:, : nq // head_dim], qk[:, nq // head_dim:]
            v = qkv[:, nq + nk:].view(tokens, -1, head_dim)
        else:
            q = _rotate(attn.q_proj(x).view(tokens, -1, head_dim), cos, sin_signed, half)
            k = _rotate(attn.k_proj(x).view(tokens, -1, head_dim), cos, sin_signed, half)
            v = attn.v_proj(x).view(tokens, -1, head_dim)
        out, _ = attend(attn, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None,
                        dropout=0.0, scaling=attn.scaling, magnitude_batch=batch)
        h += attn.o_proj(out.reshape(tokens, -1))
        x = _rms_norm(layer.post_attention_layernorm, h)
        mlp = layer.mlp
        group = _fused_group(mlp.gate_proj, mlp.up_proj)
        if group is not None:
            gate, up = group.fused(x).split(group.sizes, dim=-1)
        else:
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        h += mlp.down_proj(mlp.act_fn(gate) * up)
    return _rms_norm(inner.norm, h)
