"""The paged KV cache tensors: one device pool, one host (swap) pool, and block copies between them.

Layout: `[layers, 2 (K/V), blocks, block_size, kv_heads, head_dim]`. A layer's K (or V) viewed as
`[blocks * block_size, kv_heads, head_dim]` is indexed by *slot* = block * block_size + offset,
the numbering the scheduler's block tables use. The block ids are the scheduler's; this module
only owns the memory and the swap copies.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("magnitude.runner.kv")

ACTIVATION_HEADROOM = 0.1  # of the weights' size, kept free for a large mixed step's activations


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


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def host_available_bytes(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Memory this process can still take on the host: MemAvailable, bounded by the container's
    cgroup limit less its usage (v2 memory.max/current, else v1 limit_in_bytes/usage_in_bytes) —
    in a pod the limit, not the node's memory, is what the OOM killer enforces."""
    available = None
    for line in (proc / "meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        raise RuntimeError(f"no MemAvailable in {proc / 'meminfo'}")
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit, usage = _read_int(cgroup / limit_file), _read_int(cgroup / usage_file)
        if limit is not None and usage is not None and limit < (1 << 60):
            return max(0, min(available, limit - usage))
    return available


def default_num_blocks(shape: KVShape, device: torch.device, weight_bytes: int, memory_fraction: float = 0.9,
                       free_bytes: int | None = None, extra_bytes_per_block: int = 0) -> int:
    """Size the device pool from `kvCache.memoryFraction`: that share of the memory that was free
    before the weights (free now + the weights) holds the weights and the KV cache, less a tenth of
    the weights' size for activations. Free memory is the device's (CUDA) or the host's available
    memory within the container's limit (CPU), measured after the weights are loaded. A fraction
    too small to hold one block is refused, naming the field. `extra_bytes_per_block`: a draft
    model's K/V under the same block id (runner/draft_model.py): a block costs both."""
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"kvCache.memoryFraction must be in (0, 1], got {memory_fraction}")
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host_available_bytes()
    budget = int(memory_fraction * (free_bytes + weight_bytes)) - weight_bytes - int(weight_bytes * ACTIVATION_HEADROOM)
    per_block = shape.bytes_per_block + extra_bytes_per_block
    if budget < per_block:
        raise ValueError(
            f"kvCache.memoryFraction {memory_fraction} leaves {max(budget, 0) / 2**20:.0f} MiB for the KV cache "
            f"({free_bytes / 2**30:.2f} GiB free on {device.type} after {weight_bytes / 2**30:.2f} GiB of weights); "
            f"one block needs {per_block / 2**20:.2f} MiB: raise it or set kvCache.numBlocks")
    blocks = max(1, budget // per_block)
    log.info("KV pool: %d blocks (%.2f GiB, %d bytes a block of which %d the draft model's) = memoryFraction %s of "
             "%.2f GiB free on %s + %.2f GiB of weights, less the weights and their activation headroom",
             blocks, blocks * per_block / 2**30, per_block, extra_bytes_per_block,
             memory_fraction, free_bytes / 2**30, device.type, weight_bytes / 2**30)
    return blocks


def _anonymous_pages(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of `nbytes`, zero until written, in 4 KiB pages.

    Not from the allocator: numpy's calloc (or torch's allocator) asks for transparent huge pages on
    a large block (`MADV_HUGEPAGE`), and with the K/V of one block spread over every layer's slice
    of the pool, one short sequence then made 2 MiB resident per layer and K/V (SmolLM2: 238 MiB
    after the start-up warm-up's single block) and any few dozen blocks the whole pool. In small
    pages a block costs its own bytes when first written, and `release_pages` can give them back."""
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; THP may be set to `always`
        try:
            pages.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages: nothing to turn off
            pass
    return pages


def _zeros(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           pin: bool) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A zeroed pool, and on the CPU the mapping behind it. On the CPU the pages come from the
    kernel zeroed on first touch, so an idle pool costs address space, not memory, where
    `torch.zeros` writes every page at start. Zeros, not `torch.empty`: the attention gathers
    whole blocks and masks positions a sequence has not written, and uninitialised memory there
    could hold NaN, which a mask does not remove (NaN * 0 is NaN)."""
    if device.type != "cpu" or pin or 0 in dims:
        return torch.zeros(dims, dtype=dtype, device=device, pin_memory=pin), None
    elem = torch.empty((), dtype=dtype).element_size()
    pages = _anonymous_pages(math.prod(dims) * elem)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(dims), pages


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
        self.device_cache, self._device_pages = _zeros(dims, shape.dtype, device, pin=False)
        host_dims = (shape.num_layers, 2, num_swap_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        pin = device.type == "cuda"
        self.host_cache, self._host_pages = _zeros(host_dims, shape.dtype, torch.device("cpu"), pin=pin)
        slots = num_blocks * shape.block_size
        self.k_layers = [self.device_cache[i, 0].view(slots, shape.num_kv_heads, shape.head_dim)
                         for i in range(shape.num_layers)]
        self.v_layers = [self.device_cache[i, 1].view(slots, shape.num_kv_heads, shape.head_dim)
                         for i in range(shape.num_layers)]

    def materialize_blocks(self, n: int) -> None:
        """Write blocks 0..n-1 (zeros, as the pool starts) so that every page of them is this
        process's own, for measurements that read blocks no request wrote. On the CPU, the unwritten
        pages of the private anonymous pool all map the kernel's one shared zero page: reading a long
        context from them hits the cache every time, and a decode is timed as if its context cost
        nothing to read (SmolLM2 w4a16 on two EPYC cores: 0.8 us per context token measured over
        such pages, 2.3 us once a long prompt's K/V really is in memory). `release_pages` gives them
        back."""
        self.device_cache[:, :, :max(0, min(n, self.num_blocks))].zero_()

    def release_pages(self) -> None:
        """Give the CPU pools' pages back to the kernel, for when no sequence's K/V is in them (after
        the start-up measurements): `MADV_DONTNEED` on their private mappings, which then read as
        zeros again and cost memory only where written next. A pool elsewhere (CUDA, pinned host
        memory) is resident whatever it holds and is left as it is: what the measurements wrote
        there is finite, and a sequence writes each slot before it reads it."""
        for pages in (self._device_pages, self._host_pages):
            if pages is not None:
                try:
                    pages.madvise(mmap.MADV_DONTNEED)
                except OSError as exc:  # only memory is lost, not correctness: the pages stay as written
                    log.warning("could not give back the KV pool's pages: %s", exc)

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
