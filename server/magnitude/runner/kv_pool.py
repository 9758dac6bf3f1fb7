"""The paged KV cache tensors: one device pool, one host (swap) pool, and block copies between them.

Layout: `[layers, 2 (K/V), blocks, block_size, kv_heads, head_dim]`. A layer's K (or V) viewed as
`[blocks * block_size, kv_heads, head_dim]` is indexed by *slot* = block * block_size + offset,
the numbering the scheduler's block tables use. The block ids are the scheduler's; this module
only owns the memory and the swap copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


def blocks_for_budget(shape: KVShape, budget_bytes: int) -> int:
    return max(1, budget_bytes // shape.bytes_per_block)


def default_num_blocks(shape: KVShape, device: torch.device, weight_bytes: int) -> int:
    """Size the device pool from memory: 80% of what is free after the weights on CUDA; on CPU a
    fixed 1 GiB (the host is shared with other processes, so never take a fraction of it)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        # Keep headroom for activations of a large mixed step (logits, MLP intermediates).
        return blocks_for_budget(shape, int(free * 0.8) - weight_bytes // 10)
    return blocks_for_budget(shape, 1 << 30)


class PagedKVPool:
    """Device blocks for attention plus an optional host pool for swapped-out sequences."""

    def __init__(self, shape: KVShape, num_blocks: int, num_swap_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {num_swap_blocks}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        self.device = device
        dims = (shape.num_layers, 2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        self.device_cache = torch.zeros(dims, dtype=shape.dtype, device=device)
        host_dims = (shape.num_layers, 2, num_swap_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        pin = device.type == "cuda"
        self.host_cache = torch.zeros(host_dims, dtype=shape.dtype, device="cpu", pin_memory=pin)
        slots = num_blocks * shape.block_size
        self.k_layers = [self.device_cache[i, 0].view(slots, shape.num_kv_heads, shape.head_dim)
                         for i in range(shape.num_layers)]
        self.v_layers = [self.device_cache[i, 1].view(slots, shape.num_kv_heads, shape.head_dim)
                         for i in range(shape.num_layers)]

    def _check(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        dev = [d for d, _ in pairs]
        host = [h for _, h in pairs]
        if min(dev) < 0 or max(dev) >= self.num_blocks:
            raise IndexError(f"swap: device block out of range 0..{self.num_blocks - 1}: {dev}")
        if min(host) < 0 or max(host) >= self.num_swap_blocks:
            raise IndexError(f"swap: host block out of range 0..{self.num_swap_blocks - 1}: {host}")
        return torch.tensor(dev, dtype=torch.long), torch.tensor(host, dtype=torch.long)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (device block -> host block) for every layer, K and V, in one gather per direction."""
        if not pairs:
            return
        dev, host = self._check(pairs)
        data = self.device_cache.index_select(2, dev.to(self.device))
        self.host_cache.index_copy_(2, host, data.to("cpu", non_blocking=False))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (host block -> device block) back before the step that needs them."""
        if not pairs:
            return
        dev, host = self._check(pairs)
        data = self.host_cache.index_select(2, host).to(self.device, non_blocking=True)
        self.device_cache.index_copy_(2, dev.to(self.device), data)
