"""Predicted against real step times, step by step, on the plans real traffic makes.

    PYTHONPATH=server .venv/bin/python bench/step_prediction.py COST.json [--quantization Q] [--dtype T]
        [--trace long|mixed|TRACE.jsonl] [--threads 2] [--set KEY=VALUE ...]

Drives bench/runner_bench.py's trace (long: chats running when a 1,500-token prompt arrives; mixed:
24 requests at once), or a trace file (`magnitude trace`, or one `magnitude serve --record-trace`
wrote: its prefix groups become shared prompt tokens and its cancel times aborts, as the simulator
replays them) through the real scheduler and the real runner in one loop, in real time, with
no HTTP in between; the scheduler's limits are derived from COST.json as the engine derives them
(unless --set gives them), and its ITL bound runs on that cost model. For every step it records the
cost model's prediction (`step_seconds(plan)`, attention included) and the runner's measured
`duration_s`, then prints the sum ratio predicted / real, the median real / predicted by the number
of prefill chunks in the step, the worst decoding steps with their shapes, and the largest real
decoding step against the ITL target. It separates what the cost model gets wrong per step from
what serving adds (bench/sim_fidelity.py compares whole replays).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "bench")]

from runner_bench import long_trace, mixed_trace  # noqa: E402

from magnitude.runner import ModelRunner  # noqa: E402  (first: sets GOMP_SPINCOUNT before torch loads)
from magnitude.engine.request import Request  # noqa: E402
from magnitude.engine.sampling import SamplingParams  # noqa: E402
from magnitude.engine.scheduler import Scheduler  # noqa: E402
from magnitude.policy.load import resolve_config  # noqa: E402
from magnitude.sim.simulate import to_request  # noqa: E402
from magnitude.sim.trace import load_trace  # noqa: E402
from magnitude.sim.cost import apply_limits, cost_model_from_document, derive_scheduler_limits, plan_shape  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cost_model", help="a table cost model (GET /debug/cost-model, magnitude profile)")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--trace", default="long", help="long, mixed, or a trace file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dump", help="write every step (decodes, prefill tokens, predicted s, real s, chunks) as JSON")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()

    cost = cost_model_from_document(json.loads(Path(args.cost_model).read_text()), args.cost_model)
    config = resolve_config(None, ["kvCache.numBlocks=1024", "scheduler.maxSequences=32", *args.sets])
    limits = derive_scheduler_limits(config.scheduler, cost)
    config = apply_limits(config, limits)
    runner = ModelRunner(dtype=args.dtype, quantization=args.quantization, num_threads=args.threads,
                         evaluate_quantization=False, num_blocks=config.kv_cache.num_blocks)
    sched = Scheduler(config, num_blocks=config.kv_cache.num_blocks, cost_model=cost)
    rng = random.Random(0)
    builtin = {"long": long_trace, "mixed": mixed_trace}
    pending = sorted(builtin[args.trace]() if args.trace in builtin else load_trace(args.trace), key=lambda r: r.arrival)
    cancels = sorted((r.cancel_at, r.id) for r in pending if r.cancel_at is not None)
    rows: list[tuple[int, int, float, float, list[tuple[int, int]]]] = []
    t0 = time.monotonic()
    while pending or sched.has_work():
        now = time.monotonic() - t0
        while pending and pending[0].arrival <= now:
            r = pending.pop(0)
            if r.prefix_groups:  # recorded: shared prefixes as the simulator models them
                sched.add_request(to_request(r, config), now)
                continue
            sched.add_request(Request(
                request_id=r.id, prompt_token_ids=[rng.randint(100, 20_000) for _ in range(r.prompt_tokens)],
                num_prompt_tokens=r.prompt_tokens, arrival_time=now, tenant=r.tenant or "default",
                sampling=SamplingParams(max_tokens=r.output_tokens, ignore_eos=True, temperature=0.0),
                priority_class=r.priority_class or config.scheduler.default_priority_class), now)
        while cancels and cancels[0][0] <= now:
            sched.abort(cancels.pop(0)[1], now)
        plan = sched.schedule(now) if sched.has_work() else None
        if plan is None or plan.is_empty:
            time.sleep(0.005)
            continue
        out = runner.execute(plan)
        decodes, prefill, _ = plan_shape(plan, runner.block_size)
        chunks = [(s.start_position, len(s.token_ids)) for s in plan.seqs if not (s.sample and len(s.token_ids) == 1)]
        rows.append((decodes, prefill, cost.step_seconds(plan), out.duration_s, chunks))
        sched.update_from_output(plan, out, time.monotonic() - t0)

    if args.dump:
        Path(args.dump).write_text(json.dumps(rows))
    decoding = [r for r in rows if r[0]]
    print(f"{args.trace} trace, {runner.dtype} {runner.quantization}, limits {limits.to_document()}")
    print(f"steps {len(rows)} ({len(decoding)} with decodes); predicted / real over all steps "
          f"{sum(r[2] for r in rows) / sum(r[3] for r in rows):.3f}")
    for k in sorted({len(r[4]) for r in decoding}):
        sel = [r for r in decoding if len(r[4]) == k]
        print(f"  decoding steps with {k} prefill chunk(s): {len(sel)}, median real / predicted "
              f"{statistics.median(r[3] / r[2] for r in sel):.3f}")
    for d, p, pred, real, chunks in sorted(decoding, key=lambda r: -r[3])[:5]:
        print(f"  worst: {d} decodes + {p} prefill tokens {chunks}: predicted {pred * 1000:.0f} ms, real {real * 1000:.0f} ms")
    worst = max((r[3] for r in decoding), default=0.0)
    target = limits.itl_target_ms
    print(f"largest real decoding step {worst * 1000:.0f} ms" + (f" against the {target:g} ms ITL target" if target else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
