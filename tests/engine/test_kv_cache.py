"""The block manager alone: free list, refcounts, prefix cache with isolation keys, swap bounds."""

from __future__ import annotations

from sched_helpers import make_request

from magnitude.engine.kv_cache import KVCacheManager


def computed(req, n: int):
    req.num_computed_tokens = n
    return req


def test_allocate_grows_append_only_and_free_returns_everything() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_request("r", 10, 4)
    assert kv.allocate(r, 5)
    first = list(r.block_ids)
    assert len(first) == 2
    assert kv.allocate(r, 9)
    assert r.block_ids[:2] == first and len(r.block_ids) == 3
    assert kv.usage().used_blocks == 3
    kv.free(r)
    kv.free(r)  # idempotent
    assert kv.usage().used_blocks == 0 and r.block_ids == []
    kv.check_invariants()


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = make_request("r", 12, 1)
    assert not kv.allocate(r, 12)
    assert kv.num_free_blocks == 2 and "r" not in kv.tables
    kv.check_invariants()


def test_prefix_hit_shares_full_blocks_with_refcounts() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10))
    a = computed(make_request("a", prompt, 2, cache_key="rev1|t1"), 10)
    assert kv.allocate(a, 10)
    kv.cache_full_blocks(a)
    b = make_request("b", prompt + [99], 2, cache_key="rev1|t1")
    hits = kv.find_cached_prefix(b)
    assert hits == a.block_ids[:2]  # two full blocks; the partial third is never shared
    assert kv.allocate(b, 11, hits)
    assert kv.ref_counts[hits[0]] == 2
    kv.free(a)
    assert kv.ref_counts[hits[0]] == 1
    kv.check_invariants()


def test_prefix_hits_never_cross_isolation_keys() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    a = computed(make_request("a", prompt, 2, cache_key="rev1|tenant-a"), 12)
    assert kv.allocate(a, 12)
    kv.cache_full_blocks(a)
    for key in ("rev1|tenant-b", "rev2|tenant-a", ""):
        assert kv.find_cached_prefix(make_request("x", prompt + [1], 2, cache_key=key)) == []
    assert len(kv.find_cached_prefix(make_request("y", prompt + [1], 2, cache_key="rev1|tenant-a"))) == 3


def test_cached_blocks_survive_free_until_evicted_lru() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = computed(make_request("a", [1, 2, 3, 4, 5], 1), 5)
    assert kv.allocate(a, 5)
    kv.cache_full_blocks(a)
    kv.free(a)
    assert kv.usage().cached_free_blocks == 2 and kv.num_free_blocks == 4
    b = make_request("b", [1, 2, 3, 4, 9], 1)
    assert len(kv.find_cached_prefix(b)) == 2  # still findable after the owner left
    big = make_request("big", 8, 1)
    assert kv.allocate(big, 8)  # needs every block: the cached ones are evicted
    assert kv.find_cached_prefix(b) == []
    kv.check_invariants()


def test_swap_is_bounded_by_host_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, num_swap_blocks=3)
    a, b = make_request("a", 12, 1), make_request("b", 8, 1)
    assert kv.allocate(a, 12) and kv.allocate(b, 8)
    pairs = kv.swap_out(a)
    assert pairs is not None and len(pairs) == 3 and kv.tables.get("a") is None
    assert kv.swap_out(b) is None  # host pool full: the caller falls back to recompute
    assert kv.usage().swap_used_blocks == 3
    back = kv.swap_in(a)
    assert back is not None and [h for _, h in back] == [h for _, h in pairs]
    assert kv.usage().swap_used_blocks == 0
    kv.check_invariants()


def test_free_list_reuses_the_lowest_ids_so_touched_memory_follows_peak_use() -> None:
    """On the CPU a block's memory is resident from its first write: the ids handed out must stay
    below the most blocks ever in use at once, not cycle through the whole pool (a FIFO reached
    id 63 here after a few rounds of two small requests)."""
    import random

    rng = random.Random(7)
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    live: list = []
    highest = peak = 0
    for i in range(400):
        if live and (len(live) > 3 or rng.random() < 0.5):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            r = make_request(f"r{i}", rng.randint(1, 12), 1)
            assert kv.allocate(r, r.num_prompt_tokens)
            live.append(r)
            highest = max(highest, *r.block_ids)
        peak = max(peak, kv.usage().used_blocks)
        kv.check_invariants()
    assert highest < peak <= 12, (highest, peak)
