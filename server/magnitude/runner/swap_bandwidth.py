"""The swap figure of the cost model: how long copying KV blocks device -> host -> device takes.

`measure_swap` times the runner's own block copies (kv_pool's `swap_out` then `swap_in`, what a
swap preemption and its return cost) over as many blocks as both pools allow, after one
unmeasured round, the fastest of `repeats` rounds (other processes only ever add time), with the
device synchronised so an
asynchronous copy is not timed as free. It gives `per_swap_token` (seconds per token moved one
way: the cost model's figure, sim/cost.py) and the bandwidth it implies. `magnitude profile` and
the engine's start-up calibration call it; `preemptionMode: auto` weighs a victim's swap against
its recompute with it. The copies move device blocks out and back unchanged: call it while no
request is swapped out (host blocks are overwritten).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SwapFigures:
    per_swap_token: float  # seconds per token copied one way (0.0: no swap space to measure)
    bytes_per_s: float | None  # the copy bandwidth that implies; None without swap space
    blocks: int  # blocks copied each way per round


def _synchronize(device: Any) -> None:
    if getattr(device, "type", str(device)).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def block_bytes(kv: Any) -> int:
    """Bytes one block holds across every layer, K and V (the pool's dim 2 indexes blocks)."""
    cache = kv.device_cache
    return cache.numel() // cache.shape[2] * cache.element_size()


def measure_swap(runner: Any, repeats: int = 3, max_blocks: int = 64) -> SwapFigures:
    n = min(runner.num_blocks, runner.num_swap_blocks, max_blocks)
    if n <= 0:
        return SwapFigures(0.0, None, 0)
    pairs = [(i, i) for i in range(n)]

    def round_trip() -> float:
        t0 = time.perf_counter()
        runner.kv.swap_out(pairs)
        runner.kv.swap_in(pairs)
        _synchronize(runner.device)
        return time.perf_counter() - t0

    round_trip()  # unmeasured: first-copy effects (allocation, pinning)
    seconds = max(min(round_trip() for _ in range(max(1, repeats))), 1e-9)
    tokens = 2 * n * runner.block_size
    return SwapFigures(seconds / tokens, 2 * n * block_bytes(runner.kv) / seconds, n)
