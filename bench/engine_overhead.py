"""Per-step overhead of everything around the forward pass: scheduler, output processing
(detokenize, stop strings, metrics) and event delivery to asyncio streams.

    python bench/engine_overhead.py [--batch 1 8 32 64] [--tokens 200]

Runs the real AsyncEngine with a simulated runner whose step costs nothing, so the measured step
time is pure engine overhead; B concurrent requests of --tokens tokens each decode together.
Prints steps, wall seconds, ms per step and µs per sequence-step for each batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "operator")]

from magnitude.engine.sampling import SamplingParams  # noqa: E402
from magnitude.policy.schema import EngineConfig  # noqa: E402
from magnitude.server.async_engine import AsyncEngine, Finished, RequestSpec  # noqa: E402
from magnitude.server.metrics import EngineMetrics  # noqa: E402
from magnitude.server.simulated_runner import SimulatedRunner  # noqa: E402


async def measure(batch: int, tokens: int) -> tuple[int, float]:
    config = EngineConfig.model_validate({"kvCache": {"numBlocks": 8192}, "scheduler": {"maxSequences": max(64, batch)}})
    engine = AsyncEngine(config, lambda progress: SimulatedRunner(config, lambda plan: 0.0), EngineMetrics())
    engine.start()
    await engine.wait_ready()
    assert engine.loop is not None
    start_steps = engine.loop.steps
    t0 = time.perf_counter()
    streams = [
        engine.submit(RequestSpec(list(b"prompt %d" % i), SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), "standard"))
        for i in range(batch)
    ]

    async def drain(stream) -> None:  # type: ignore[no-untyped-def]
        async for ev in stream:
            if isinstance(ev, Finished):
                assert ev.completion_tokens == tokens

    await asyncio.gather(*(drain(s) for s in streams))
    wall = time.perf_counter() - t0
    steps = engine.loop.steps - start_steps
    await engine.shutdown(0)
    return steps, wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--tokens", type=int, default=200)
    args = p.parse_args()
    print(f"{'batch':>5} {'steps':>6} {'wall_s':>7} {'ms/step':>8} {'us/seq-step':>12}")
    for b in args.batch:
        steps, wall = asyncio.run(measure(b, args.tokens))
        print(f"{b:>5} {steps:>6} {wall:>7.2f} {wall / steps * 1e3:>8.2f} {wall / steps / b * 1e6:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
