"""The paged KV block manager: device blocks, host swap blocks, prefix cache.

Owns block ids, nothing else: a free list, reference counts, one append-only block table per
resident request, and a map from full-block keys to cached blocks. A block key is
`(hash of the previous block's key, isolation key, token ids)`; the isolation key (model
revision, adapter, tokenizer, chat template, tenant: the request's `cache_key`) is compared
exactly, so a cache hit can never cross a tenant or a revision.

Freed blocks that hold a cached prefix stay findable until they are reused: they wait in an
LRU of evictable blocks and are only evicted when the plain free list is empty. The plain free
list hands out the lowest free id: on the CPU a block's memory is resident from its first write
(runner/kv_pool.py), so the pool's resident part follows the most blocks ever in use (and
cached) instead of creeping over every id as a FIFO would cycle through them.
Pure: no torch, no I/O. The runner owns the memory these ids point at.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from magnitude.engine.request import Request

BlockKey = tuple[int, str, tuple[int, ...]]


@dataclass(slots=True)
class KVUsage:
    used_blocks: int  # referenced by a resident request
    cached_free_blocks: int  # unreferenced, still holding a reusable prefix
    total_blocks: int
    swap_used_blocks: int
    swap_total_blocks: int

    @property
    def usage_ratio(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


class KVCacheManager:
    """Block pool with prefix caching and a bounded host swap pool."""

    def __init__(self, num_blocks: int, block_size: int, num_swap_blocks: int = 0, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1 or num_swap_blocks < 0:
            raise ValueError(f"bad KV geometry: num_blocks={num_blocks} block_size={block_size} swap={num_swap_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_swap_blocks = num_swap_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks))  # heap; never cached (or evicted): handed out first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached, LRU first
        self._block_key: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self.tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of each table already registered in the cache
        self._last_hash: dict[str, int] = {}
        self._host_free: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        # Host blocks a swap-in reads this step: free only from the next step on (see begin_step).
        self._host_pending: list[int] = []
        self.host_tables: dict[str, list[int]] = {}
        self.num_used = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.alloc_failures = 0  # allocations (or can_allocate checks) the pool could not satisfy

    # ---- figures ----
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (plain free plus evictable cached)."""
        return len(self._free) + len(self._evictable)

    def usage(self) -> KVUsage:
        return KVUsage(
            used_blocks=self.num_used,
            cached_free_blocks=len(self._evictable),
            total_blocks=self.num_blocks,
            swap_used_blocks=self.num_swap_blocks - len(self._host_free) - len(self._host_pending),
            swap_total_blocks=self.num_swap_blocks,
        )

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----
    def _key(self, parent: int, cache_key: str, tokens: list[int]) -> BlockKey:
        return (parent, cache_key, tuple(tokens))

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks matching the request's leading full blocks (never the whole sequence:
        at least one token must be computed to sample from)."""
        if not self.enable_prefix_caching or request.prompt_token_ids is None:
            return []
        self.prefix_queries += 1
        bs = self.block_size
        limit = (request.num_tokens - 1) // bs
        blocks: list[int] = []
        parent = 0
        tokens = request.all_token_ids()
        for i in range(limit):
            key = self._key(parent, request.cache_key, tokens[i * bs : (i + 1) * bs])
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
            parent = hash(key)
        if blocks:
            self.prefix_hits += 1
        return blocks

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks so later requests can share them."""
        if not self.enable_prefix_caching or request.prompt_token_ids is None:
            return
        rid = request.request_id
        done = self._num_hashed.get(rid, 0)
        full = request.num_computed_tokens // self.block_size
        if full <= done:  # the common decode step: no block became full
            return
        table = self.tables.get(rid)
        if table is None:
            return
        full = min(full, len(table))
        if full <= done:
            return
        bs = self.block_size
        parent = self._last_hash.get(rid, 0)
        tokens = request.token_ids(done * bs, full * bs)
        for i in range(done, full):
            key = self._key(parent, request.cache_key, tokens[(i - done) * bs : (i - done + 1) * bs])
            block = table[i]
            # A block already registered under another key, or a key already served by another
            # block, stays as it is: block tables are append-only, ids never change under a request.
            if key not in self._cached and self._block_key[block] is None:
                self._cached[key] = block
                self._block_key[block] = key
            parent = hash(key)
        self._num_hashed[rid] = full
        self._last_hash[rid] = parent

    # ---- allocation ----
    def _take(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        else:
            block, _ = self._evictable.popitem(last=False)
            key = self._block_key[block]
            if key is not None:
                del self._cached[key]
                self._block_key[block] = None
        self.ref_counts[block] = 1
        self.num_used += 1
        return block

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self._evictable.pop(block, None)
            self.num_used += 1
        self.ref_counts[block] += 1

    def can_allocate(self, request: Request, num_tokens: int, cached: list[int] | None = None, reserve: int = 0) -> bool:
        """Whether `allocate` would succeed and still leave `reserve` blocks free."""
        table = self.tables.get(request.request_id)
        have = len(table) if table is not None else len(cached or ())
        need = self.blocks_for(num_tokens) - have
        if table is None and cached:
            need += sum(1 for b in cached if self.ref_counts[b] == 0)  # hits leaving the evictable LRU
        if max(0, need) + reserve <= self.num_free_blocks:
            return True
        self.alloc_failures += 1
        return False

    def allocate(self, request: Request, num_tokens: int, cached: list[int] | None = None) -> bool:
        """Grow the request's table to cover `num_tokens` positions; False (nothing changed) if
        there are not enough free blocks. `cached` are prefix-cache hits for a fresh table."""
        rid = request.request_id
        table = self.tables.get(rid)
        if table is None:
            table = []
            if cached:
                # Hits that sit in the evictable LRU are not free for this allocation.
                need = self.blocks_for(num_tokens) - len(cached)
                reusable = sum(1 for b in cached if self.ref_counts[b] == 0)
                if need > self.num_free_blocks - reusable:
                    self.alloc_failures += 1
                    return False
                for b in cached:
                    self._ref(b)
                table.extend(cached)
                self._num_hashed[rid] = len(cached)
                self._last_hash[rid] = hash(self._block_key[cached[-1]])
            self.tables[rid] = table
            request.block_ids = table
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self._free) + len(self._evictable):
            if not table:
                del self.tables[rid]
            self.alloc_failures += 1
            return False
        for _ in range(need):
            table.append(self._take())
        return True

    def free(self, request: Request) -> None:
        """Drop the request's references (device and host); idempotent."""
        rid = request.request_id
        table = self.tables.pop(rid, None)
        if table is not None:
            # Tail blocks first into the LRU: a shared prefix's head outlives its tail.
            for block in reversed(table):
                ref = self.ref_counts[block] - 1
                assert ref >= 0, f"block {block} freed twice"
                self.ref_counts[block] = ref
                if ref == 0:
                    self.num_used -= 1
                    if self._block_key[block] is not None:
                        self._evictable[block] = None
                    else:
                        heapq.heappush(self._free, block)
        self._num_hashed.pop(rid, None)
        self._last_hash.pop(rid, None)
        host = self.host_tables.pop(rid, None)
        if host is not None:
            self._host_free.extend(reversed(host))
        request.block_ids = []

    # ---- swap ----
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host memory: (device, host) copies, or None if the host
        pool is too small (nothing changed)."""
        rid = request.request_id
        table = self.tables.get(rid, [])
        if len(table) > len(self._host_free):
            return None
        pairs = [(b, self._host_free.pop()) for b in table]
        self.free(request)
        self.host_tables[rid] = [h for _, h in pairs]
        return pairs

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request back: (device, host) copies (the StepPlan contract), or None if
        device blocks are short."""
        rid = request.request_id
        host = self.host_tables.get(rid)
        if host is None:
            return None
        if len(host) > self.num_free_blocks:
            return None
        del self.host_tables[rid]
        table = [self._take() for _ in host]
        self.tables[rid] = table
        request.block_ids = table
        self._host_pending.extend(reversed(host))
        return list(zip(table, host))

    def begin_step(self) -> None:
        """Host blocks read by the last step's swap-ins are free again (their copies have run)."""
        if self._host_pending:
            self._host_free.extend(self._host_pending)
            self._host_pending.clear()

    @property
    def num_free_host_blocks(self) -> int:
        """Host blocks a swap-out may take now (those read by this step's swap-ins are not yet free)."""
        return len(self._host_free)

    def num_host_blocks(self, request: Request) -> int:
        return len(self.host_tables.get(request.request_id, ()))

    # ---- invariants ----
    def check_invariants(self) -> None:
        """No block leaked or double-owned; counts agree. O(blocks): tests and debug only."""
        refs = [0] * self.num_blocks
        for table in self.tables.values():
            for b in table:
                refs[b] += 1
        assert refs == self.ref_counts, "reference counts disagree with block tables"
        free = set(self._free)
        assert len(free) == len(self._free), "block twice in the free list"
        ev = set(self._evictable)
        assert not free & ev, "block both free and evictable"
        for b in range(self.num_blocks):
            in_free = b in free or b in ev
            assert in_free == (refs[b] == 0), f"block {b}: ref {refs[b]} but free={in_free}"
        assert self.num_used == sum(1 for r in refs if r), "used-block count drifted"
        for key, b in self._cached.items():
            assert self._block_key[b] == key, f"cache map and block {b} disagree"
        host = [h for t in self.host_tables.values() for h in t] + self._host_free + self._host_pending
        assert sorted(host) == list(range(self.num_swap_blocks)), "host block leaked or double-owned"
