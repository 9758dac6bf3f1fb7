"""Where one step's time goes in the real runner: attention, projections, MLP, LM head, sampling,
step preparation and the rest (Python/framework overhead, norms, RoPE, embeddings).

    .venv/bin/python bench/step_profile.py [--threads 2] [--decodes 8] [--prefill 64] [--context 256] [--steps 10]
        [--prefill-start 0] [--dtype T] [--quantization Q]
    .venv/bin/python bench/step_profile.py --sweep [--batches 1,2,4,8] [--contexts 100,1000] [--hf-generate 129]

`--compare float32:none,float32:w4a16,bfloat16:none` loads one runner per dtype:quantization (a third
field picks the low-bit kernels, `float32:w4a16:torch`; runner/lowbit.py; a fourth the KV pool's dtype,
`float32:w4a16::float16`, else the runner's default, kvCache.dtype auto) and
runs their decode steps (every --batches x --contexts; and prefill chunks of --prefills tokens, alone
or as D+N beside D decodes) interleaved, one step of each in turn, so a
shared host's noise falls on all of them alike; prints median wall and process-CPU ms per step
and the ratio to the first variant.

`--compare-decoders` loads one runner (--dtype, --quantization, its KV pool in --kv-dtype) and runs
the same cells through transformers' forward, the runner's lean forward (runner/paged_decoder.py)
and, for a w4a16 model on Magnitude's kernels, the fused decode step (runner/fused_decode.py),
interleaved.

`--compare-head` loads one runner (--dtype, --quantization with an int8 group LM head: w4a16, w4a8,
w4a16-int16 on Magnitude's kernels) and runs the same cells with the head's rows in fp32 and in
int16 (`Int8GroupLinear.activations`; w4a16-int16's head takes int16), interleaved.

`--memory` loads the runner (--dtype, --quantization) and prints where its resident memory is:
live tensor bytes by kind (distinct storages) against the process's anonymous and file-backed RSS.

`--sweep` profiles pure decode steps (no prefill) for every batch size x context and prints one
row per cell (ms per step and the same split); `--hf-generate N` then times Hugging Face
`generate` (greedy, one stream, N new tokens, its own cache) on the same loaded weights, the
floor the runner's batch-1 step is compared with.

`--prefill-start S` puts the chunk at positions S..S+prefill (a chunk deep in a long prompt, which
attends to S earlier tokens): the long-prompt trace's worst step is about `--decodes 12 --context 100
--prefill 96 --prefill-start 1400`.

Wall-clock timers on module forward hooks (CPU ops are synchronous, so hooks bracket real work;
on CUDA the script synchronizes in each hook, which slows it but keeps the split honest).
Prints seconds per step and percentages for a mixed step of `--decodes` decodes plus one prefill
chunk of `--prefill` tokens, after warm-up.
The hooks themselves (a few per layer) cost time that lands in the norms/RoPE row: a profiled
step is slower than an unhooked one (`--compare-decoders` times unhooked steps).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server")]

from magnitude.runner import ModelRunner  # noqa: E402  (first: sets GOMP_SPINCOUNT before torch loads)
from magnitude.runner import attention as paged  # noqa: E402
try:  # the plan helpers moved from the profile command into runner/calibration.py
    from magnitude.runner.calibration import _plan, blocks_needed  # noqa: E402
except ImportError:
    from magnitude.cli.profile import _plan, blocks_needed  # noqa: E402
from magnitude.engine.output import ScheduledSeq  # noqa: E402
from magnitude.runner.fused_decode import fused_decoder  # noqa: E402
from magnitude.runner.paged_decoder import _rms_norm, lean_family, lean_forward, paged_decoder, transformers_decoder  # noqa: E402
from magnitude.runner.quantize import Int4FusedMember, Int8GroupLinear  # noqa: E402

import torch  # noqa: E402


class Timers:
    def __init__(self, cuda: bool) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.cuda = cuda
        self._start: dict[int, float] = {}
        self.handles: list = []

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def hook(self, module: torch.nn.Module, label: str) -> None:
        key = id(module)

        def pre(*_a, **_k):
            self._start[key] = self.now()

        def post(*_a, **_k):
            self.total[label] += self.now() - self._start.pop(key)

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _step_plan(decodes: int, prefill: int, context: int, prefill_start: int, block_size: int):
    """`decodes` decodes at `context` plus one `prefill`-token chunk at positions prefill_start.."""
    plan = _plan(decodes, prefill, context, block_size, 0)
    if prefill and prefill_start:
        # The same chunk, deep in its prompt: its block table covers the earlier positions too.
        chunk = plan.seqs[-1]
        base = chunk.block_table[0]
        end = prefill_start + prefill
        plan.seqs[-1] = ScheduledSeq(chunk.request_id, chunk.token_ids, prefill_start,
                                     list(range(base, base + -(-end // block_size))), True, chunk.sampling)
    return plan


def _profile(runner: ModelRunner, timers: Timers, decodes: int, prefill: int, context: int, prefill_start: int,
             steps: int) -> tuple[float, list[tuple[str, float]]]:
    """Mean step seconds and its split for `decodes` decodes at `context` plus one `prefill` chunk."""
    plan = _step_plan(decodes, prefill, context, prefill_start, runner.block_size)
    for _ in range(2):
        runner.execute(plan)
    timers.total.clear()
    prepare = sample = total = 0.0
    cpu0 = time.process_time()
    for _ in range(steps):
        runner.execute(plan)
        st = runner.last_step
        prepare, sample, total = prepare + st.prepare_s, sample + st.sample_s, total + st.total_s
    n = steps
    t = defaultdict(float, {k: v / n for k, v in timers.total.items()})  # a fused step fires no inner hooks
    core = t["paged attention core (cache write, gather, SDPA)"]
    rows = [
        ("paged attention core (cache write, gather, SDPA)", core),
        ("q/k/v/o projections", t["attention projections"]),
        ("MLP projections", t["MLP projections"]),
        ("norms, RoPE, activation, residuals, embeddings",
         t["decoder forward"] - core - t["attention projections"] - t["MLP projections"]),
        ("lm head (sampled rows only)", t["lm head"]),
        ("sampling", sample / n),
        ("step preparation (index tensors)", prepare / n),
    ]
    accounted = sum(v for _, v in rows)
    rows.append(("other (python, dispatch, output)", total / n - accounted))
    # CPU seconds of the whole process per step: on a shared host, wall time includes waiting for
    # a core; with --threads 1 this is the step's own work.
    rows.append(("process CPU time", (time.process_time() - cpu0) / n))
    return total / n, rows


def _hf_generate_ms_per_token(runner: ModelRunner, new_tokens: int) -> tuple[float, float]:
    """Greedy `generate` on the runner's own model object (plain causal attention without the
    paged batch), one stream, best of 3: (wall, process CPU) ms per generated token after the first."""
    ids = runner.tokenizer("The history of the city begins with", return_tensors="pt")["input_ids"].to(runner.device)
    best = best_cpu = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            t0, c0 = time.perf_counter(), time.process_time()
            runner.model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
            t0, c0 = time.perf_counter(), time.process_time()
            runner.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            best = min(best, (time.perf_counter() - t0 - first) / (new_tokens - 1))
            best_cpu = min(best_cpu, (time.process_time() - c0 - first_cpu) / (new_tokens - 1))
    return best * 1000, best_cpu * 1000


def _pool_blocks(batches: list[int], contexts: list[int], prefills: list[tuple[int, int, int]]) -> int:
    """KV blocks for the largest decode batch (alone or beside a chunk) and the longest chunk."""
    return blocks_needed([max([*batches, *(d for d, _, _ in prefills)])],
                         [max([1, *(n + start for _, n, start in prefills)])], max(contexts), 16)


def compare(variants: list[str], batches: list[int], contexts: list[int], steps: int, threads: int | None,
            prefills: list[tuple[int, int, int]]) -> None:
    from magnitude.runner import lowbit

    runners = {}
    for v in variants:
        dtype, _, rest = v.partition(":")
        quantization, _, rest = rest.partition(":")
        kernel, _, kv_dtype = rest.partition(":")
        previous = os.environ.get(lowbit.KERNEL_ENV)
        if kernel:  # the low-bit kernels are chosen as the model's linears are built
            os.environ[lowbit.KERNEL_ENV] = kernel
        try:
            runners[v] = ModelRunner(dtype=dtype, quantization=quantization or "none", num_threads=threads,
                                     evaluate_quantization=False, kv_cache_dtype=kv_dtype or "auto",
                                     num_blocks=_pool_blocks(batches, contexts, prefills))
        finally:
            if previous is None:
                os.environ.pop(lowbit.KERNEL_ENV, None)
            else:
                os.environ[lowbit.KERNEL_ENV] = previous
    _interleaved({v: r.execute for v, r in runners.items()}, batches, contexts, steps, prefills)


def compare_head(dtype: str | None, quantization: str | None, batches: list[int], contexts: list[int], steps: int,
                 threads: int | None, prefills: list[tuple[int, int, int]]) -> None:
    """One runner, its steps with the int8 group LM head's rows in fp32 and in int16, interleaved."""
    runner = ModelRunner(dtype=dtype, quantization=quantization, num_threads=threads, evaluate_quantization=False,
                         num_blocks=_pool_blocks(batches, contexts, prefills))
    head = runner.model.lm_head
    if not isinstance(head, Int8GroupLinear):
        raise SystemExit(f"--compare-head needs an int8 group LM head (w4a16, w4a8, w4a16-int16 on Magnitude's "
                         f"kernels); this runner's is {type(head).__name__}")

    def with_head(activations: str):
        def run(plan):
            head.activations = activations
            return runner.execute(plan)
        return run

    _interleaved({"head fp32": with_head("fp32"), "head int16": with_head("int16")}, batches, contexts, steps, prefills)


def compare_decoders(dtype: str | None, quantization: str | None, batches: list[int], contexts: list[int], steps: int,
                     threads: int | None, prefills: list[tuple[int, int, int]], kv_dtype: str = "auto") -> None:
    """One runner (its KV pool in `kv_dtype`), its steps through transformers' forward, the lean
    forward and (for a model it runs) the fused decode step in turn."""
    runner = ModelRunner(dtype=dtype, quantization=quantization, num_threads=threads, evaluate_quantization=False,
                         num_blocks=_pool_blocks(batches, contexts, prefills), kv_cache_dtype=kv_dtype)
    inner = runner.model.model
    forwards = {"transformers": transformers_decoder(inner)}
    family = lean_family(inner)
    if family is not None:
        forwards["lean"] = lambda ids, pos, batch: lean_forward(inner, family, ids, pos, batch)
        every = fused_decoder(inner, family.window, choose=lambda batch: True)
        if every is not None:
            forwards["fused (every step)"] = lambda ids, pos, batch: _rms_norm(inner.norm, every(ids, pos, batch))
            forwards["as served (runs_fused)"] = paged_decoder(inner)

    def through(forward):
        def execute(plan):
            runner._decoder = forward
            return runner.execute(plan)
        return execute

    print(f"dtype {runner.dtype}, quantization {runner.quantization}, KV pool {runner.kv_cache_dtype}")
    _interleaved({k: through(f) for k, f in forwards.items()}, batches, contexts, steps, prefills)


def _interleaved(variants: dict, batches: list[int], contexts: list[int], steps: int,
                 prefills: list[tuple[int, int, int]]) -> None:
    """Each cell's steps run one of each variant in turn, so a shared host's noise falls on all alike."""
    import statistics

    print(f"interleaved decode steps, median of {steps}; threads {torch.get_num_threads()}, "
          f"ISA {torch.backends.cpu.get_cpu_capability()}; ms wall / ms process CPU (ratio to {next(iter(variants))})")
    print(f"{'batch':>5} {'ctx':>5} " + " ".join(f"{v:>30}" for v in variants))
    cells = [(b, c, 0, 0) for c in contexts for b in batches] + [(d, contexts[0], n, start) for d, n, start in prefills]
    for b, c, n, start in cells:
        plan = _step_plan(b, n, c, start, 16)
        times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
        for i in range(steps + 2):
            for v, execute in variants.items():
                t0, c0 = time.perf_counter(), time.process_time()
                execute(plan)
                if i >= 2:  # the first two warm up
                    times[v].append((time.perf_counter() - t0, time.process_time() - c0))
        med = {v: (statistics.median(x[0] for x in t) * 1000, statistics.median(x[1] for x in t) * 1000)
               for v, t in times.items()}
        base = next(iter(med.values()))
        chunk = f"prefill {n}" + (f"@{start}" if start else "")
        label = f"{b:5d} {c:5d} " if not n else f"{(f'{b}+' if b else '') + chunk:>11} "
        print(label + " ".join(
            f"{m[0]:7.1f}/{m[1]:6.1f} ({m[0] / base[0]:4.2f}/{m[1] / base[1]:4.2f})".rjust(30) for m in med.values()),
            flush=True)


def memory_report(runner: ModelRunner) -> None:
    import gc
    import warnings

    gc.collect()
    storages: dict[int, tuple[int, str]] = {}
    weights = {id(t) for t in (*runner.model.parameters(), *runner.model.buffers())}
    with warnings.catch_warnings():  # isinstance on some of gc's objects warns (deprecated torch modules)
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "cpu"]
    for o in tensors:
        st = o.untyped_storage()
        kind = "weights" if id(o) in weights else "other tensors (KV pool views, buffers)"
        if storages.get(st.data_ptr(), (0, ""))[1] != "weights":
            storages[st.data_ptr()] = (st.nbytes(), kind)
    by_kind: dict[str, int] = defaultdict(int)
    for nbytes, kind in storages.values():
        by_kind[kind] += nbytes
    status = {k: int(v.split()[0]) // 1024 for k, _, v in
              (line.partition(":") for line in Path("/proc/self/status").read_text().splitlines())
              if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
    print(f"dtype {runner.dtype}, quantization {runner.quantization}, KV blocks {runner.num_blocks}: "
          + ", ".join(f"{k} {v // 2**20} MiB" for k, v in by_kind.items())
          + "; process " + ", ".join(f"{k} {v} MiB" for k, v in status.items()))


def _prefill_cells(spec: str) -> list[tuple[int, int, int]]:
    """"64,64@1000,16+48" -> [(0, 64, 0), (0, 64, 1000), (16, 48, 0)]: decodes beside the chunk (at
    the first --contexts length), chunk lengths and their first positions."""
    cells = []
    for item in filter(None, spec.split(",")):
        decodes, _, chunk = item.rpartition("+")
        n, _, start = chunk.partition("@")
        cells.append((int(decodes or 0), int(n), int(start or 0)))
    return cells


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--decodes", type=int, default=8)
    p.add_argument("--prefill", type=int, default=64)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prefill-start", type=int, default=0, help="position of the chunk's first token")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", default=None, help="none, w8a8, w8a16 or w4a16 (default: the runner's)")
    p.add_argument("--sweep", action="store_true", help="decode-only steps for every --batches x --contexts")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--contexts", default="100,1000")
    p.add_argument("--hf-generate", type=int, default=0, metavar="N",
                   help="also time HF generate of N greedy tokens, one stream, on the same weights")
    p.add_argument("--prefills", default="",
                   help="--compare: also prefill chunks of these lengths (N, or N@S for positions S..S+N), "
                        "alone or beside D decodes at the first --contexts length (D+N, D+N@S)")
    p.add_argument("--compare", default=None, metavar="DTYPE:QUANT,...",
                   help="interleaved decode steps of several variants (see above)")
    p.add_argument("--compare-decoders", action="store_true",
                   help="one runner (--dtype, --quantization): transformers' forward against the lean one, interleaved")
    p.add_argument("--compare-head", action="store_true",
                   help="one runner (--dtype, --quantization): its int8 LM head's rows in fp32 against int16, interleaved")
    p.add_argument("--memory", action="store_true", help="where the loaded runner's resident memory is")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", "float32", "float16"),
                   help="--compare-decoders: the KV pool's dtype (kvCache.dtype)")
    args = p.parse_args()
    if args.kv_dtype != "auto" and not args.compare_decoders:
        p.error("--kv-dtype applies to --compare-decoders only (--compare takes a pool dtype as a variant's fourth field)")
    if args.memory:
        memory_report(ModelRunner(dtype=args.dtype, quantization=args.quantization, num_threads=args.threads,
                                  evaluate_quantization=False, num_blocks=64))
        return 0
    if args.compare_decoders:
        compare_decoders(args.dtype, args.quantization, [int(b) for b in args.batches.split(",")],
                         [int(c) for c in args.contexts.split(",")], args.steps, args.threads,
                         _prefill_cells(args.prefills), args.kv_dtype)
        return 0
    if args.compare_head:
        compare_head(args.dtype, args.quantization, [int(b) for b in args.batches.split(",")],
                     [int(c) for c in args.contexts.split(",")], args.steps, args.threads, _prefill_cells(args.prefills))
        return 0
    if args.compare:
        compare(args.compare.split(","), [int(b) for b in args.batches.split(",")],
                [int(c) for c in args.contexts.split(",")], args.steps, args.threads,
                _prefill_cells(args.prefills))
        return 0
    batches = [int(b) for b in args.batches.split(",")] if args.sweep else [args.decodes]
    contexts = [int(c) for c in args.contexts.split(",")] if args.sweep else [args.context]
    prefill = 0 if args.sweep else args.prefill
    runner = ModelRunner(device=args.device, dtype=args.dtype, num_threads=args.threads, quantization=args.quantization,
                         evaluate_quantization=False,
                         num_blocks=blocks_needed([max(batches)], [max(prefill, 1) + args.prefill_start],
                                                  max(contexts), 16))
    timers = Timers(runner.device.type == "cuda")
    # Leaf projections (a fused w4a16 group's product once, not its members' slices) and the whole
    # decoder call: hooks on self_attn or mlp would not fire under the lean forward, which calls
    # their projections but not the modules themselves.
    for layer in runner.model.model.layers:
        for part, label in ((layer.self_attn, "attention projections"), (layer.mlp, "MLP projections")):
            for m in part.modules():
                if hasattr(m, "in_features") and not isinstance(m, Int4FusedMember):
                    timers.hook(m, label)
    timers.hook(runner.model.lm_head, "lm head")
    decoder = runner._decoder

    def timed_decoder(*a):
        t0 = timers.now()
        try:
            return decoder(*a)
        finally:
            timers.total["decoder forward"] += timers.now() - t0

    runner._decoder = timed_decoder

    inner = paged.paged_attention_forward

    def timed_attention(*a, **k):
        t0 = timers.now()
        try:
            return inner(*a, **k)
        finally:
            timers.total["paged attention core (cache write, gather, SDPA)"] += timers.now() - t0

    paged.AttentionInterface.register(paged.ATTN_IMPLEMENTATION, timed_attention)
    what = (f"device {runner.device}, dtype {runner.dtype}, quantization {runner.quantization}, "
            f"threads {torch.get_num_threads()}, ISA {torch.backends.cpu.get_cpu_capability()}")
    family = lean_family(runner.model.model)
    if family is not None and fused_decoder(runner.model.model, family.window) is not None:
        # No hooks fire inside the native call: its projections and attention land in "glue".
        what += "; steps runs_fused takes run the decoder layers in one native call (their whole time is in 'glue')"
    if not args.sweep:
        mean, rows = _profile(runner, timers, args.decodes, args.prefill, args.context, args.prefill_start, args.steps)
        print(f"step: {args.decodes} decodes (context {args.context}) + {args.prefill}-token prefill chunk at "
              f"{args.prefill_start}; {what}")
        print(f"mean step time {mean * 1000:.1f} ms over {args.steps} steps")
        for name, v in rows[:-1]:
            print(f"  {name:50} {v * 1000:8.1f} ms  {100 * v / mean:5.1f}%")
        print(f"  {rows[-1][0]:50} {rows[-1][1] * 1000:8.1f} ms")
    else:
        print(f"decode-only steps, ms (mean of {args.steps}); {what}")
        short = ["attn core", "qkvo", "mlp", "glue", "lm head", "sampling", "prepare", "other", "cpu"]
        print(f"{'batch':>5} {'ctx':>5} {'step':>7} " + " ".join(f"{h:>9}" for h in short))
        for c in contexts:
            for b in batches:
                mean, rows = _profile(runner, timers, b, 0, c, 0, args.steps)
                print(f"{b:5d} {c:5d} {mean * 1000:7.1f} " + " ".join(f"{v * 1000:9.2f}" for _, v in rows))
    if args.hf_generate:
        timers.remove()  # generate's own time, without the split's hooks
        paged.AttentionInterface.register(paged.ATTN_IMPLEMENTATION, inner)
        wall, cpu = _hf_generate_ms_per_token(runner, args.hf_generate)
        print(f"HF generate, one stream, {args.hf_generate} greedy tokens on the same weights: "
              f"{wall:.1f} ms/token (process CPU {cpu:.1f} ms/token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
