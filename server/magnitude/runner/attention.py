"""Paged attention over Magnitude's KV pool, plugged into transformers' attention interface.

`build_paged_batch` turns one step's sequences (flattened into a single token row) into index
tensors once per step; `paged_attention_forward` runs per layer: it writes the new tokens' K/V
into their slots, gathers each sequence's cached prefix + new K/V by slot index (vectorised, no
per-token Python), and runs torch SDPA with a per-sequence causal mask. Sequences are grouped by
shape (decodes, then prefill chunks) so a 1-token decode is never padded to a long chunk.
Without a `magnitude_batch` kwarg the function falls back to stock SDPA, so the same model object
still works with `model.generate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTN_IMPLEMENTATION = "magnitude_paged"


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
    kv_slots: torch.Tensor  # [B, Lmax] cache slots of positions 0..Lmax-1 (padding -> slot 0)
    mask: torch.Tensor | None  # [B, 1, Qmax, Lmax] bool, True = attend; None = plain causal, no padding
    src_rows: torch.Tensor | None  # valid rows of the [B*Qmax] output (None: all, in order)
    dst_rows: torch.Tensor | None  # where they go in the flattened output


@dataclass(slots=True)
class PagedBatch:
    slot_mapping: torch.Tensor  # [T] slot each new token's K/V is written to
    groups: list[AttnGroup]
    k_layers: list[torch.Tensor]  # per layer [slots, kv_heads, head_dim]
    v_layers: list[torch.Tensor]
    num_tokens: int
    identity_output: bool  # one group covering every row in order: no scatter needed


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
    tables = _padded_tables(seqs, (l_max + block_size - 1) // block_size)

    j = np.arange(q_max, dtype=np.int64)[None, :]
    q_valid = j < n[:, None]
    q_index = np.where(q_valid, offset[:, None] + j, 0)
    q_pos = np.where(q_valid, start[:, None] + j, 0)  # padding rows see only position 0 (no NaN rows)
    p = np.broadcast_to(np.arange(l_max, dtype=np.int64)[None, :], (len(seqs), l_max))
    ctx = (start + n)[:, None]
    kv_slots = np.where(p < ctx, _slots(tables, np.minimum(p, ctx - 1), block_size), 0)

    plain_causal = len(seqs) == 1 and start[0] == 0  # whole prompt from scratch: SDPA's is_causal
    single_decode = len(seqs) == 1 and q_max == 1
    mask = None
    if not plain_causal and not single_decode:
        mask = torch.from_numpy(p[:, None, :] <= q_pos[:, :, None]).unsqueeze(1).to(device)

    src_rows = dst_rows = None
    if not (len(seqs) == 1 and q_max == total_tokens):
        flat_valid = np.flatnonzero(q_valid.reshape(-1))
        src_rows = torch.from_numpy(flat_valid).to(device)
        dst_rows = torch.from_numpy(q_index.reshape(-1)[flat_valid]).to(device)
    return AttnGroup(
        q_index=torch.from_numpy(q_index).to(device),
        kv_slots=torch.from_numpy(kv_slots).to(device),
        mask=mask,
        src_rows=src_rows,
        dst_rows=dst_rows,
    )


def build_paged_batch(
    seqs: list[SeqSlice],
    block_size: int,
    k_layers: list[torch.Tensor],
    v_layers: list[torch.Tensor],
    device: torch.device,
) -> PagedBatch:
    """Index tensors for one step. Cost is per sequence (numpy over padded arrays), not per token."""
    total = sum(s.n for s in seqs)
    new_pos = np.concatenate([np.arange(s.start, s.start + s.n, dtype=np.int64) for s in seqs])
    seq_of_token = np.repeat(np.arange(len(seqs)), [s.n for s in seqs])
    width = max(len(s.block_table) for s in seqs)
    tables = _padded_tables(seqs, width)[seq_of_token]
    slot_mapping = _slots(tables, new_pos[:, None], block_size)[:, 0]

    decodes = [s for s in seqs if s.n == 1]
    chunks = [s for s in seqs if s.n > 1]
    groups = [_group(g, block_size, device, total) for g in (decodes, chunks) if g]
    return PagedBatch(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        groups=groups,
        k_layers=k_layers,
        v_layers=v_layers,
        num_tokens=total,
        identity_output=len(groups) == 1 and groups[0].src_rows is None,
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
    if batch is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    layer = module.layer_idx
    k_cache, v_cache = batch.k_layers[layer], batch.v_layers[layer]
    # Write first: a sequence's new tokens attend to themselves through the cache.
    k_cache.index_copy_(0, batch.slot_mapping, key[0].transpose(0, 1))
    v_cache.index_copy_(0, batch.slot_mapping, value[0].transpose(0, 1))

    q_rows = query[0].transpose(0, 1)  # [T, heads, head_dim]
    heads, head_dim = q_rows.shape[1], q_rows.shape[2]
    out = None if batch.identity_output else q_rows.new_empty(batch.num_tokens, heads, head_dim)
    for g in batch.groups:
        q = q_rows[g.q_index].transpose(1, 2)  # [B, heads, Qmax, D]
        k = k_cache[g.kv_slots].transpose(1, 2)  # [B, kv_heads, Lmax, D]
        v = v_cache[g.kv_slots].transpose(1, 2)
        res = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=g.mask, is_causal=g.mask is None and q.shape[2] > 1,
            scale=scaling, enable_gqa=True,
        )
        res = res.transpose(1, 2)  # [B, Qmax, heads, D]
        if out is None:
            return res, None
        flat = res.reshape(-1, heads, head_dim)
        out.index_copy_(0, g.dst_rows, flat.index_select(0, g.src_rows))
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
