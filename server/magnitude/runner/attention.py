"""Paged attention over Magnitude's KV pool, plugged into transformers' attention interface.

`build_paged_batch` turns one step's sequences (flattened into a single token row) into index
tensors once per step; `paged_attention_forward` runs per layer: it writes the new tokens' K/V
into their slots, gathers each sequence's cached prefix + new K/V *by whole blocks* (one indexed
copy of block_size rows at a time, vectorised, no per-token Python), and runs torch SDPA with a
per-sequence causal mask. Sequences are grouped by shape (decodes apart from prefill chunks) and by
context length (a bucket never pads to more than twice its shortest context), so a 1-token decode
is never padded to a long chunk and 12 short chats are not padded to one 1,500-token context.
Without a `magnitude_batch` kwarg the function falls back to plain causal attention (with the
layer's window and soft-capping), so the same model object still works with `model.generate` for
one unpadded sequence (transformers builds no padding mask for a custom attention function).

Two per-layer options transformers passes with the call are honoured, not ignored: `sliding_window`
(Mistral, Qwen2/3, Gemma 2/3, Phi-3: a key is seen only if `query position - key position <
window`, transformers' own rule) as an extra mask built once per step and group for each window
size, and `softcap` (Gemma 2's attention logit soft-capping, `tanh(s / cap) * cap` before the
softmax), which SDPA cannot do, so those layers run the attention as explicit matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTN_IMPLEMENTATION = "magnitude_paged"
BUCKET_MIN_LEN = 128  # contexts shorter than this always share a bucket (padding them is cheap)


@dataclass(slots=True)
class SeqSlice:
    """One sequence's tokens in the flattened step: `offset..offset+n` rows, positions `start..start+n`."""

    offset: int
    n: int
    start: int
    block_table: list[int]


@dataclass(slots=True)
class AttnGroup:
    """Sequences attended together in one padded SDPA call."""

    q_index: torch.Tensor  # [B, Qmax] rows of the flattened step (padding -> row 0)
    kv_blocks: torch.Tensor  # [B, NB] block ids covering positions 0..NB*bs-1 (padding -> block 0)
    kv_len: int  # Lmax: keys beyond it are cut off after the gather (a view)
    mask: torch.Tensor | None  # [B, 1, Qmax, Lmax] bool, True = attend; None = plain causal, no padding
    src_rows: torch.Tensor | None  # valid rows of the [B*Qmax] output (None: all, in order)
    dst_rows: torch.Tensor | None  # where they go in the flattened output
    # One sequence whose rows and blocks are consecutive (a fresh pool hands out runs of blocks):
    # its queries and K/V are plain slices, no gather copy (a chunk deep in a long prompt copied
    # ~2 MB of K/V per layer otherwise). None when the gather is needed.
    q_offset: int | None = None
    kv_first_slot: int | None = None
    # Each row's query position (padding rows: 0), for masks built on demand (sliding windows).
    q_pos: np.ndarray | None = None
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # Gather buffers, allocated at the first layer and reused by the others: a fresh multi-MB
    # tensor per layer cost more in page faults than the copy itself (5.8 vs 3.5 ms per layer for a
    # chunk attending to 1,500 tokens).
    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None


@dataclass(slots=True)
class PagedBatch:
    slot_mapping: torch.Tensor  # [T] slot each new token's K/V is written to
    seqs: list[SeqSlice]
    k_layers: list[torch.Tensor]  # per layer [slots, kv_heads, head_dim]
    v_layers: list[torch.Tensor]
    block_size: int
    num_tokens: int
    device: torch.device
    # Per row of the flattened step: its position and its sequence's block table (zero-padded to the
    # step's widest), for code that attends row by row (runner/fused_decode.py).
    row_positions: np.ndarray  # [T] int64
    row_tables: np.ndarray  # [T, W] int64
    decode_rows: int  # rows that are a sequence's one new token (the rest are prompt chunks' rows)
    _groups: list[AttnGroup] | None = None

    @property
    def groups(self) -> list[AttnGroup]:
        """The SDPA groups (decodes apart from chunks, bucketed by context), built on first use: a
        step the fused forward takes never reads them (a batch-1 step spent ~70 µs building them)."""
        if self._groups is None:
            decodes = [s for s in self.seqs if s.n == 1]
            chunks = [s for s in self.seqs if s.n > 1]
            self._groups = [_group(b, self.block_size, self.device, self.num_tokens)
                            for g in (decodes, chunks) if g for b in _buckets(g)]
        return self._groups

    @property
    def identity_output(self) -> bool:
        """One group covering every row in order: no scatter needed."""
        groups = self.groups
        return len(groups) == 1 and groups[0].src_rows is None


def _slots(block_tables: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Slot of each position: block_table[p // bs] * bs + p % bs (rows broadcast per sequence)."""
    blocks = np.take_along_axis(block_tables, positions // block_size, axis=1)
    return blocks * block_size + positions % block_size


def _padded_tables(seqs: list[SeqSlice], width: int) -> np.ndarray:
    width = max([width, 1] + [len(s.block_table) for s in seqs])
    tables = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_table)] = s.block_table
    return tables


def _group(seqs: list[SeqSlice], block_size: int, device: torch.device, total_tokens: int) -> AttnGroup:
    n = np.array([s.n for s in seqs], dtype=np.int64)
    start = np.array([s.start for s in seqs], dtype=np.int64)
    offset = np.array([s.offset for s in seqs], dtype=np.int64)
    q_max = int(n.max())
    l_max = int((start + n).max())
    num_blocks = (l_max + block_size - 1) // block_size
    kv_blocks = _padded_tables(seqs, num_blocks)[:, :num_blocks]

    j = np.arange(q_max, dtype=np.int64)[None, :]
    q_valid = j < n[:, None]
    q_index = np.where(q_valid, offset[:, None] + j, 0)
    q_pos = np.where(q_valid, start[:, None] + j, 0)  # padding rows see only position 0 (no NaN rows)

    plain_causal = len(seqs) == 1 and start[0] == 0  # whole prompt from scratch: SDPA's is_causal
    single_decode = len(seqs) == 1 and q_max == 1  # attends to every key up to l_max
    mask = None
    if not plain_causal and not single_decode:
        p = np.arange(l_max, dtype=np.int64)[None, None, :]
        mask = torch.from_numpy(p <= q_pos[:, :, None]).unsqueeze(1).to(device)

    q_offset = kv_first_slot = None
    if len(seqs) == 1:
        q_offset = int(offset[0])
        if num_blocks == 1 or bool(np.all(np.diff(kv_blocks[0]) == 1)):
            kv_first_slot = int(kv_blocks[0, 0]) * block_size

    src_rows = dst_rows = None
    if not (len(seqs) == 1 and q_max == total_tokens):
        flat_valid = np.flatnonzero(q_valid.reshape(-1))
        src_rows = torch.from_numpy(flat_valid).to(device)
        dst_rows = torch.from_numpy(q_index.reshape(-1)[flat_valid]).to(device)
    return AttnGroup(
        q_index=torch.from_numpy(q_index).to(device),
        kv_blocks=torch.from_numpy(np.ascontiguousarray(kv_blocks)).to(device),
        kv_len=l_max,
        mask=mask,
        src_rows=src_rows,
        dst_rows=dst_rows,
        q_offset=q_offset,
        kv_first_slot=kv_first_slot,
        q_pos=q_pos,
    )


def _group_mask(g: AttnGroup, window: int | None, device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) for this group, with a sliding window when it cuts anything off. A window
    no shorter than the longest context changes nothing, so the plain mask (or none) is kept."""
    if window is None or window >= g.kv_len:
        return g.mask, g.mask is None and g.q_index.shape[1] > 1
    mask = g.window_masks.get(window)
    if mask is None:
        p = np.arange(g.kv_len, dtype=np.int64)[None, None, :]
        q = g.q_pos[:, :, None]
        mask = torch.from_numpy((p <= q) & (p > q - window)).unsqueeze(1).to(device)
        g.window_masks[window] = mask
    return mask, False


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         is_causal: bool, scale: float | None, softcap: float) -> torch.Tensor:
    """Attention with logit soft-capping, as Gemma 2's eager attention computes it (scores scaled,
    `tanh(s / cap) * cap`, masked, softmax in float32). q [B, H, Q, D]; k, v [B, KVH, L, D]."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and is_causal:
        # Queries are the last Q of L positions (a whole prompt from position 0: Q == L).
        ql, kl = q.shape[2], k.shape[2]
        mask = torch.ones(ql, kl, dtype=torch.bool, device=q.device).tril(kl - ql)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(probs, v)


def _buckets(seqs: list[SeqSlice]) -> list[list[SeqSlice]]:
    """Split by context length so padding stays under 2x (contexts under BUCKET_MIN_LEN share one)."""
    min_len = BUCKET_MIN_LEN
    out: list[list[SeqSlice]] = []
    first = 0
    for s in sorted(seqs, key=lambda s: s.start + s.n):
        ctx = s.start + s.n
        if out and ctx <= max(2 * first, min_len):
            out[-1].append(s)
        else:
            out.append([s])
            first = ctx
    return out


def build_paged_batch(
    seqs: list[SeqSlice],
    block_size: int,
    k_layers: list[torch.Tensor],
    v_layers: list[torch.Tensor],
    device: torch.device,
) -> PagedBatch:
    """Index tensors for one step (the SDPA groups when first asked for). Cost is per sequence (numpy
    over padded arrays), not per token."""
    total = sum(s.n for s in seqs)
    new_pos = np.concatenate([np.arange(s.start, s.start + s.n, dtype=np.int64) for s in seqs])
    seq_of_token = np.repeat(np.arange(len(seqs)), [s.n for s in seqs])
    width = max(len(s.block_table) for s in seqs)
    tables = _padded_tables(seqs, width)[seq_of_token]
    slot_mapping = _slots(tables, new_pos[:, None], block_size)[:, 0]

    return PagedBatch(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        seqs=seqs,
        k_layers=k_layers,
        v_layers=v_layers,
        block_size=block_size,
        num_tokens=total,
        device=device,
        row_positions=new_pos,
        row_tables=tables,
        decode_rows=sum(1 for s in seqs if s.n == 1),
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    batch: PagedBatch | None = kwargs.pop("magnitude_batch", None)
    window: int | None = kwargs.pop("sliding_window", None)
    softcap: float | None = kwargs.pop("softcap", None)
    if batch is None:
        # transformers builds no mask for an attention function it has no mask function for (its
        # custom-backend rule), so this fallback (`model.generate` on the runner's model: one
        # unpadded sequence whose queries are the last of its keys) applies the window and the
        # soft-capping itself; plain causal attention otherwise.
        ql, kl = query.shape[2], key.shape[2]
        if attention_mask is None and (softcap or (window and kl > window)):
            q_pos = torch.arange(kl - ql, kl, device=query.device)[:, None]
            k_pos = torch.arange(kl, device=query.device)[None, :]
            mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
            if softcap:
                out = softcapped_attention(query, key, value, mask, False, scaling, softcap)
            else:
                out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                                       enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=window, **kwargs)

    layer = module.layer_idx
    k_cache, v_cache = batch.k_layers[layer], batch.v_layers[layer]
    out_dtype = query.dtype
    # Write first: a sequence's new tokens attend to themselves through the cache. Attention runs in
    # the wider of the cache's and the model's dtypes: fp32 for a bf16 model over an fp32 cache on
    # the CPU, and for any model over a float16 cache (kvCache.dtype), whose K/V are read widened.
    compute = torch.promote_types(k_cache.dtype, out_dtype)
    k_cache.index_copy_(0, batch.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(0, batch.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))

    q_rows = query[0].transpose(0, 1).to(compute)  # [T, heads, head_dim]
    heads, head_dim = q_rows.shape[1], q_rows.shape[2]
    kv_heads = k_cache.shape[1]
    k_blocks = k_cache.view(-1, batch.block_size, kv_heads, head_dim)
    v_blocks = v_cache.view(-1, batch.block_size, kv_heads, head_dim)
    out = None if batch.identity_output else query.new_empty(batch.num_tokens, heads, head_dim)
    for g in batch.groups:
        if g.q_offset is not None:
            q = q_rows[g.q_offset : g.q_offset + g.q_index.shape[1]][None].transpose(1, 2)  # [1, heads, n, D]
        else:
            q = q_rows[g.q_index].transpose(1, 2)  # [B, heads, Qmax, D]
        if g.kv_first_slot is not None:
            kv = slice(g.kv_first_slot, g.kv_first_slot + g.kv_len)
            k, v = k_cache[kv][None].to(compute).transpose(1, 2), v_cache[kv][None].to(compute).transpose(1, 2)
        else:
            b, nb = g.kv_blocks.shape
            if g.k_buf is None:
                g.k_buf, g.v_buf = torch.empty_like(k_blocks[: b * nb]), torch.empty_like(v_blocks[: b * nb])
            flat = g.kv_blocks.view(-1)
            torch.index_select(k_blocks, 0, flat, out=g.k_buf)
            torch.index_select(v_blocks, 0, flat, out=g.v_buf)
            k = g.k_buf.view(b, nb * batch.block_size, kv_heads, head_dim)[:, : g.kv_len].to(compute).transpose(1, 2)
            v = g.v_buf.view(b, nb * batch.block_size, kv_heads, head_dim)[:, : g.kv_len].to(compute).transpose(1, 2)
        mask, causal = _group_mask(g, window, query.device)
        if softcap:
            res = softcapped_attention(q, k, v, mask, causal, scaling, softcap)
        else:
            res = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=True,
            )
        res = res.transpose(1, 2).to(out_dtype)  # [B, Qmax, heads, D]
        if out is None:
            return res, None
        flat = res.reshape(-1, heads, head_dim)
        out.index_copy_(0, g.dst_rows, flat.index_select(0, g.src_rows))
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
