"""How the runner runs a decoder over one step's paged batch: `paged_decoder(inner)` returns the
function (input_ids [1, T], position_ids [1, T], PagedBatch) -> last hidden state [T, hidden].

For transformers' Llama, Mistral and Qwen2 classes (SmolLM2, Llama 2/3, Mistral 7B, Qwen2/2.5, and
every checkpoint that loads as them; the three differ only in the sliding window each layer hands
the attention) it is a lean forward: the same modules and the same tensor operations in the same
order as transformers' own forward, so its output is the same bit for bit
(tests/runner/test_paged_decoder.py checks it on the CPU for fp32, bf16, w4a16, w8a16 and w8a8, and
for each family, windows included), without the per-call framework work around them
(decorators, output capture, keyword plumbing, module calls for layers, attention, MLP and norms).
At one decode per step that work was about a seventh of the step (`bench/step_profile.py
--compare-decoders`). Two reorderings stay exact: RoPE's rotate-half is a roll times a sign-folded
sine (negation is exact), and with fused w4a16/w4a8 projections the queries and keys, adjacent in the
q/k/v product, are rotated in one pass (the rotation is element-wise). Residual additions are done
in place (the embedding lookup returns fresh rows).

Because the layers, attention, MLP and norm modules are not called as modules, forward hooks on
them do not fire here (the projections are still module calls, except in fused steps, which call
none). Code that hooks them calls the model itself (quantization's calibration pass) or a decoder
built without the fused step (the evaluation's reference, whose projections give back their pages:
file_pages.released_after_use).

Any other architecture (Gemma's scaled embeddings and soft-capping, Qwen3's q/k norms, Phi-3's
fused projections live in their own forwards), a model whose modules are not exactly those classes,
or one set to another attention implementation runs through transformers' forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama as llama
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.qwen2 import modeling_qwen2 as qwen2

from magnitude.runner.attention import ATTN_IMPLEMENTATION, PagedBatch
from magnitude.runner.fused_decode import _fused_group, fused_decoder
from magnitude.runner.quantize import Int8GroupEmbedding

DecoderFn = Callable[[torch.Tensor, torch.Tensor, PagedBatch], torch.Tensor]


@dataclass(frozen=True)
class _Family:
    """transformers' classes of one Llama-shaped family, and the sliding window each layer passes to
    the attention function (Mistral's from the config, Qwen2's per layer type, Llama none)."""

    model: type
    layer: type
    attention: type
    mlp: type
    norm: type
    rotary: type
    window: Callable[[nn.Module], int | None]


FAMILIES = (
    _Family(llama.LlamaModel, llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP, llama.LlamaRMSNorm,
            llama.LlamaRotaryEmbedding, lambda attn: None),
    _Family(mistral.MistralModel, mistral.MistralDecoderLayer, mistral.MistralAttention, mistral.MistralMLP,
            mistral.MistralRMSNorm, mistral.MistralRotaryEmbedding,
            lambda attn: getattr(attn.config, "sliding_window", None)),
    _Family(qwen2.Qwen2Model, qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention, qwen2.Qwen2MLP, qwen2.Qwen2RMSNorm,
            qwen2.Qwen2RotaryEmbedding, lambda attn: attn.sliding_window),
)


def paged_decoder(inner: nn.Module, fused: bool = True) -> DecoderFn:
    """The forward for `inner` (a causal LM's `.model`): lean for a Llama-shaped family, its own
    otherwise; with `fused`, the decode steps (and short chunks) of a w4a16/w4a8 model on
    Magnitude's kernels, or of a bf16 one, run fused (fused_decode.py). A fused forward has
    `fused = True`. The runner asks for none before it quantizes a model: the evaluation's
    reference is the model as loaded, through the modules whose calls give back their weight pages."""
    family = lean_family(inner)
    if family is None:
        return transformers_decoder(inner)
    native = fused_decoder(inner, family.window) if fused else None
    if native is None:
        return lambda input_ids, position_ids, batch: lean_forward(inner, family, input_ids, position_ids, batch)

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        h = native(input_ids, position_ids, batch)  # the final norm included
        return lean_forward(inner, family, input_ids, position_ids, batch) if h is None else h

    forward.fused = True  # type: ignore[attr-defined]
    return forward


def transformers_decoder(inner: nn.Module) -> DecoderFn:
    """transformers' own forward of `inner` over the paged batch (also the lean forward's reference)."""

    def transformers_forward(input_ids: torch.Tensor, position_ids: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        return inner(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                     magnitude_batch=batch).last_hidden_state[0]

    return transformers_forward


def lean_family(inner: nn.Module) -> _Family | None:
    """The family whose classes every module the lean forward stands in for is exactly (a subclass
    may change any step, so it is not taken for one), when the model attends through the paged
    attention (the lean forward calls it whatever the config says); None otherwise."""
    family = next((f for f in FAMILIES if type(inner) is f.model), None)
    if family is None or type(inner.embed_tokens) not in (nn.Embedding, Int8GroupEmbedding):
        return None
    if getattr(inner.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return None
    if type(inner.norm) is not family.norm or type(inner.rotary_emb) is not family.rotary:
        return None
    plain = all(
        type(layer) is family.layer and type(layer.self_attn) is family.attention and type(layer.mlp) is family.mlp
        and type(layer.input_layernorm) is family.norm and type(layer.post_attention_layernorm) is family.norm
        for layer in inner.layers
    )
    return family if plain else None


def _rms_norm(norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm.forward (Mistral's and Qwen2's are the same), operation for operation."""
    dtype = h.dtype
    x = h.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, half: int) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x, half) * sin_signed."""
    return (x * cos) + (x.roll(half, dims=-1) * sin_signed)


def lean_forward(inner: nn.Module, family: _Family, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 batch: PagedBatch) -> torch.Tensor:
    """The family's Model.forward over the paged batch (no cache object, no masks: the paged
    attention builds its own), returning the final-norm hidden state of every row, [T, hidden]."""
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
                        dropout=0.0, scaling=attn.scaling, sliding_window=family.window(attn), magnitude_batch=batch)
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
