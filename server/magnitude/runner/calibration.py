"""Step-cost calibration: the one measuring function behind `magnitude profile` and the engine's
start-up `calibrating` phase, and the cache that lets a restart skip it.

`profile_runner` times real `runner.execute` calls over a grid of (decode batch size, prefill
tokens): `d` decodes at a fixed context length (over pool blocks written first, as a request's
are) plus one prefill chunk of `p` tokens, each cell timed between two runs of a reference step
(one decode) and taken relative to them, the median over `repeats` passes of the grid (the
engine's third pass only where a cell's first two disagree), times the reference's median; then
the attention figures (runner/attention_cost.py: what a
decode pays per context token beyond that length, a chunk deep in a long prompt per query-key
pair) and the swap rate. Its result is the simulator's `table` cost model document
(sim/cost.py reads it; `GET /debug/cost-model` returns it). `calibrated_cost_model` is the engine's
entry: the cached table for this model, weights and hardware, else a short measurement (the grid
below, widened where its prefill columns end before the efficient step, and the attention figures:
on two Xeon cores with AMX, SmolLM2 fp32 14 s on the grid, w4a16-bf16prefill 10 s and bf16 12 s
with a 512-token column added), reported as progress and written to
`$MAGNITUDE_CACHE/cost-models/<key>.json` — unless the load average exceeded this process's CPUs
while measuring: such a table is used, not kept.

Torch-free at import (the key's ISA description imports torch only when called), so the CLI can
import it cheaply.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from magnitude.engine.output import ScheduledSeq, StepPlan
from magnitude.engine.sampling import SamplingParams
from magnitude.runner.attention_cost import materialize, measure_attention
from magnitude.runner.swap_bandwidth import measure_swap
from magnitude.sim.cost import READING_PACE_ITL_MS, cost_model_from_document, efficient_step_past_table

log = logging.getLogger(__name__)

# The start-up grid: small on purpose (15 cells that do work, 2-3 passes). The table is interpolated between
# these points and extrapolated linearly beyond them (sim/cost.py).
CALIBRATION_DECODES = (0, 1, 4, 16)
CALIBRATION_PREFILLS = (0, 16, 64, 256)
CALIBRATION_CONTEXT = 256
CALIBRATION_REPEATS = 3
# A cell's third pass runs only where its first two differ by more than this: the median of three
# always lies between the first two, so where they agree within 5% the third could move the cell by
# less than that (the grid's 256-token column is most of the calibration's time).
CALIBRATION_AGREEMENT = 0.05
# The attention figures' prefill chunk (a typical derived chunk is 128-256 tokens) and the share of
# the calibration's progress the grid stands for (the attention pairs take about the rest).
ATTENTION_CHUNK = 128
GRID_SHARE = 0.6
ATTENTION_REPEATS = 5
# Bumped when the measurement changes meaning, so cached tables from older code are not reused.
CALIBRATION_VERSION = "18"  # 2: per_swap_token by measure_swap; 3: the attention figures, median cells;
# 4: the lean Llama forward (runner/paged_decoder.py), small decode steps about 15% cheaper;
# 5: Magnitude's low-bit kernels (runner/lowbit.py) for w4a16/w8a16;
# 6: the fused step's vectorised attention and its routing by chunk keys (runner/fused_decode.py);
# 7: the fused step attends a chunk's rows together (since then the key also names the low-bit
# kernels' build, lowbit.describe(), so kernel changes re-measure on their own);
# 8: the engine's third pass only for cells whose first two disagree (CALIBRATION_AGREEMENT);
# 9: contexts read from written pool pages (attention_cost.materialize), 2 far decodes;
# 10: the fused step bounds chunk rows only (fused_decode.FUSED_MAX_CHUNK_ROWS): cells of many decodes beside a chunk run fused
# 11: cells relative to a reference step run beside each (REFERENCE_DECODES)
# 12-13: under w4a16-bf16prefill chunks of up to 512 rows and 150k keys run fused (fused_decode.*_BF16)
# 14: wider prefill columns where the efficient step lies past the grid (CALIBRATION_WIDEST_PREFILL)
# 15: not where the wider column's step would pass CALIBRATION_WIDEST_STEP_S
# 16: under w4a16-bf16prefill over a float16 pool chunks of up to 270k keys run fused (their reads widened once)
# 17: under w4a16 chunks of up to 512 rows and 150k keys run fused (its products blocked for many rows)
# 18: under w4a16 chunks run fused up to 128 rows on the AVX2 build, none on the portable one

# The grid's prefill columns are doubled, up to this many tokens, while the efficient prefill-only
# step lies past the last one (sim/cost.py efficient_step_past_table): the default ITL target is
# judged only within the measured columns. On two Intel Xeon cores with AMX, the engine's bf16
# calibration timed prefill-only steps of 16, 64 and 256 tokens at 38, 107 and 207 ms (the rate
# still climbing at 256) and the widened 512 and 1,024 at 346 and 663 ms (2026-12-05,
# tests/sim/test_cost.py): a table ending at 256 derived a 256-token chunk, and those limits served
# the 24-request burst at 0.75 of budget 1,024's throughput, widened to 512 0.93
# (bench/results/derived_defaults.md). Tables whose efficient step lies within the grid (w4a16
# there: 119-202 tokens on the two lines) measure nothing more.
CALIBRATION_WIDEST_PREFILL = 1024
# Nor is a column measured whose prefill-only step the last two columns' line puts past twice
# reading pace: such a step is a stall no default should choose. fp32 on those cores (256 tokens
# 328 ms, 512 tokens 600 ms) widened to 512, and then the derived step moved between 256 and 512
# tokens (targets of about 480 and 739 ms) as the served line's fixed cost moved, and the
# simulator's ITL p50 of its replays ran 0.57-0.77 and 1.15 of the engine's
# (bench/results/sim_fidelity.md, 2026-12-05 20:21-20:27).
CALIBRATION_WIDEST_STEP_S = 2 * READING_PACE_ITL_MS / 1000.0

# The reference step timed before and after every measured cell: one decode at the grid's context, the
# cheapest step (one more step per measured cell: 18-20 ms each on two AVX2 EPYC cores, under a second
# of a 27 s w4a16 calibration). A shared host's speed drifts over seconds, there by half within a
# minute (a 64-token prefill step took 153-319 ms within 40 s, each step's time correlating 0.4-0.8
# with the decode run just before it), so cells measured seconds apart disagree in proportion. Over
# the mean of its two references a cell varies less (that 64-token step over 138 runs: a coefficient
# of variation of 0.147 as timed, 0.112 relative; a median of three: 0.087 and 0.064), so the table's
# shape, which sets the derived chunk, is more the host's than that minute's. The median reference
# restores seconds.
REFERENCE_DECODES = 1
REFERENCE_ID = "reference"

ProgressFn = Callable[[float], None]


def _plan(d: int, p: int, context: int, block_size: int, step: int) -> StepPlan:
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    per_seq = -(-(context + 1) // block_size)
    seqs = [ScheduledSeq(f"d{i}", [100], context, list(range(i * per_seq, (i + 1) * per_seq)), True, greedy)
            for i in range(d)]
    if p:
        base = d * per_seq
        seqs.append(ScheduledSeq("p", [100] * p, 0, list(range(base, base + -(-p // block_size))), True, greedy))
    return StepPlan(step, seqs)


def blocks_needed(decodes: list[int], prefills: list[int], context: int, block_size: int) -> int:
    """Pool blocks the grid (and its reference step) reads and writes."""
    return max(*decodes, REFERENCE_DECODES) * -(-(context + 1) // block_size) + -(-max(prefills) // block_size) + 1


def _reference_plan(context: int, block_size: int, step: int) -> StepPlan:
    """REFERENCE_DECODES decodes at the grid's context, over the first decode's blocks (request ids
    REFERENCE_ID-i, so a scripted runner can tell them from the grid's)."""
    plan = _plan(REFERENCE_DECODES, 0, context, block_size, step)
    for i, seq in enumerate(plan.seqs):
        seq.request_id = f"{REFERENCE_ID}-{i}"
    return plan


def profile_runner(runner: Any, decodes: list[int], prefills: list[int], context: int, repeats: int,
                   progress: ProgressFn | None = None, attention: bool = True,
                   agreement: float | None = None, widest_prefill: int | None = None) -> dict:
    """The cost-model document for this runner (kind `table`). One unmeasured run of the largest
    cell (first-shape effects), then `repeats` passes over the grid, every measured cell between
    two runs of the reference step (_reference_plan; REFERENCE_DECODES says why): a cell's time is
    the median over passes of its time over the mean of the references around it, times the
    median reference. The simulator and the ITL bound predict the steps the engine will run, which
    jitter as these do (the fastest pass put replays of the engine's own traffic 6-12% fast; a
    burst of other load lands on one pass of a cell, which the median drops), and the table is made
    non-decreasing along both axes (more work never costs less), which the ITL bound's searches
    rely on. `progress(fraction)` after each measured cell (the grid and the columns it may widen
    to are the first GRID_SHARE of the work; where it widens less, progress skips the rest).
    `attention=False` leaves the attention
    figures out (a benchmark that reads only the table's cells). `agreement` (the engine's
    CALIBRATION_AGREEMENT): passes after the second measure only the cells whose relative times so
    far differ by more than that fraction of the smallest. `widest_prefill` (the engine's
    CALIBRATION_WIDEST_PREFILL, within its pool): while the efficient prefill-only step lies past
    the last prefill column (efficient_step_past_table) and a step of twice its tokens is predicted
    within CALIBRATION_WIDEST_STEP_S (_doubled_step_seconds), a column of that many tokens is
    measured the same way, every decode row, up to `widest_prefill` (`meta.widened` lists them)."""
    block_size = runner.block_size
    prefills = list(prefills)
    materialize(runner, blocks_needed(decodes, prefills, context, block_size))
    step_ids = itertools.count(1)
    runner.execute(_plan(max(decodes), max(prefills), context, block_size, 0))
    relative: list[list[list[float]]] = [[[] for _ in prefills] for _ in decodes]
    references: list[float] = []
    widened: list[int] = []

    def reference() -> float:
        references.append(max(runner.execute(_reference_plan(context, block_size, next(step_ids))).duration_s, 1e-9))
        return references[-1]

    cells = [(i, j) for i in range(len(decodes)) for j in range(len(prefills))]
    doublings = 0  # the columns the grid may widen to
    while widest_prefill is not None and 0 < prefills[-1] << (doublings + 1) <= widest_prefill:
        doublings += 1
    planned = max(1, repeats) * (len(cells) + doublings * len(decodes))
    work = {"done": 0, "shown": 0.0}

    def advance(done: int) -> None:
        work["done"] = done
        fraction = done / planned * (GRID_SHARE if attention else 1.0)
        if progress is not None and fraction > work["shown"]:
            work["shown"] = fraction
            progress(fraction)

    before = reference()

    def measure(cells: list[tuple[int, int]]) -> None:
        nonlocal before
        for n in range(max(1, repeats)):
            for i, j in cells:
                d, p = decodes[i], prefills[j]
                so_far = relative[i][j]
                settled = (agreement is not None and n >= 2 and bool(so_far)
                           and max(so_far) <= (1.0 + agreement) * min(so_far))
                if (d or p) and not settled:  # an empty step does nothing: leave it at the floor
                    took = runner.execute(_plan(d, p, context, block_size, next(step_ids))).duration_s
                    after = reference()
                    so_far.append(took / ((before + after) / 2.0))
                    before = after
                advance(work["done"] + 1)

    measure(cells)
    while widest_prefill is not None and 0 < 2 * prefills[-1] <= widest_prefill:
        table = cost_model_from_document({"kind": "table", "decode_batch_sizes": decodes, "prefill_tokens": prefills,
                                          "seconds": _seconds(relative, references)})
        if not efficient_step_past_table(table) or _doubled_step_seconds(table) > CALIBRATION_WIDEST_STEP_S:
            break
        prefills.append(2 * prefills[-1])
        widened.append(prefills[-1])
        for row in relative:
            row.append([])
        runner.execute(_plan(max(decodes), prefills[-1], context, block_size, 0))  # first shape, unmeasured (step 0)
        before = reference()  # each cell between the references beside it, as in the grid
        measure([(i, len(prefills) - 1) for i in range(len(decodes))])
    advance(planned)  # the columns not widened to
    scale = statistics.median(references)
    doc = {
        "kind": "table",
        "decode_batch_sizes": decodes,
        "prefill_tokens": prefills,
        "seconds": _seconds(relative, references),
        "per_swap_token": measure_swap(runner, max(1, repeats)).per_swap_token,
        "block_size": block_size,
        "meta": {
            "model": runner.model_name,
            "device": str(runner.device),
            "dtype": str(runner.dtype).removeprefix("torch."),
            "quantization": getattr(runner, "quantization", "none") or "none",
            "kv_cache_dtype": getattr(runner, "kv_cache_dtype", "float32"),
            "decode_context_tokens": context,
            "repeats": repeats,
            "agreement": agreement,
            "passes": sum(len(v) for row in relative for v in row),
            "reference_step_seconds": scale,
            "widened": widened,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    }
    if attention:
        doc.update(measure_attention(runner, context, chunk=ATTENTION_CHUNK, repeats=ATTENTION_REPEATS).to_document())
        if progress is not None:
            progress(1.0)
    return doc


def _doubled_step_seconds(table: Any) -> float:
    """A prefill-only step of twice the table's last column, on its line through the last two
    columns (the table's own extrapolation)."""
    return table.seconds_for(0, 2 * int(max(table.prefill_tokens)))


def _seconds(relative: list[list[list[float]]], references: list[float]) -> list[list[float]]:
    """The table's cells: each cell's median relative time times the median reference, made
    non-decreasing along both axes."""
    scale = statistics.median(references)
    seconds = [[max(statistics.median(v) * scale if v else 0.0, 1e-6) for v in row] for row in relative]
    for i, row in enumerate(seconds):
        for j in range(len(row)):
            row[j] = max(row[j], row[j - 1] if j else 0.0, seconds[i - 1][j] if i else 0.0)
    return seconds


def calibration_grid(runner: Any) -> tuple[list[int], list[int], int]:
    """The start-up grid, shrunk to what this runner's KV pool and context can hold."""
    context = max(1, min(CALIBRATION_CONTEXT, runner.max_model_len - 1))
    prefills = [p for p in CALIBRATION_PREFILLS if p < runner.max_model_len] or [0]
    decodes = list(CALIBRATION_DECODES)
    while len(decodes) > 2 and blocks_needed(decodes, prefills, context, runner.block_size) > runner.num_blocks:
        decodes.pop()
    while len(prefills) > 2 and blocks_needed(decodes, prefills, context, runner.block_size) > runner.num_blocks:
        prefills.pop()
    if blocks_needed(decodes, prefills, context, runner.block_size) > runner.num_blocks:
        raise ValueError(f"the KV pool ({runner.num_blocks} blocks) is too small to calibrate step costs; "
                         "pass --cost-model FILE (from `magnitude profile`)")
    return decodes, prefills, context


def widest_prefill(runner: Any, grid: tuple[list[int], list[int], int]) -> int:
    """The widest prefill column the calibration may add (CALIBRATION_WIDEST_PREFILL, doubling the
    grid's last): within the model's length and beside the grid's decodes in the KV pool."""
    decodes, prefills, context = grid
    widest = max(prefills)
    while (0 < 2 * widest <= CALIBRATION_WIDEST_PREFILL and 2 * widest < runner.max_model_len
           and blocks_needed(decodes, [*prefills, 2 * widest], context, runner.block_size) <= runner.num_blocks):
        widest *= 2
    return widest


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cost_model_key(runner: Any, grid: tuple[list[int], list[int], int], widest: int | None = None) -> str:
    """What the measured times depend on: model source and pinned revision, dtype, weight format,
    KV pool dtype, device, CPU model and ISA, torch version (quant_eval.cache_key adds the last two),
    threads, the grid itself and how far it may widen, and the low-bit kernels' build where the steps run on it (low-bit
    weights; a bf16 model whose steps run fused: runner/fused_decode.py)."""
    import torch

    from magnitude.runner import lowbit
    from magnitude.runner.quant_eval import cache_key, kernel_description

    src = getattr(runner, "model_source", None)
    device = str(runner.device)
    if device.startswith("cuda"):
        device += f" {torch.cuda.get_device_name(runner.device)}"
    return cache_key(
        "cost-model", CALIBRATION_VERSION,
        getattr(src, "source", "") or runner.model_name, getattr(src, "revision", "") or "",
        str(runner.dtype), getattr(runner, "quantization", "none") or "none", device, _cpu_model(),
        f"threads={torch.get_num_threads()}", f"block={runner.block_size}", json.dumps(grid),
        *([f"widest={widest}"] if widest is not None else []),
        kernel_description(getattr(runner, "quantization", "none") or "none"),
        # named only when not fp32, so tables measured over an fp32 pool keep their keys
        *([f"kv={kv_dtype}"] if (kv_dtype := getattr(runner, "kv_cache_dtype", "float32")) != "float32" else []),
        *([f"lowbit={lowbit.describe(bf16_products=False)}"]
          if str(runner.dtype) == "torch.bfloat16" and getattr(runner, "fused_steps", False) else []),
    )


def load_cached(directory: Path, key: str) -> dict | None:
    path = directory / f"{key}.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # a torn or foreign file: measure again
        log.warning("ignoring unreadable cost model %s: %s", path, exc)
        return None
    if not isinstance(doc, dict) or doc.get("kind") != "table":
        log.warning("ignoring cost model %s: not a table", path)
        return None
    return doc


def save_cached(directory: Path, key: str, doc: dict) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, directory / f"{key}.json")  # atomic: pods sharing the volume never read half a file
    except OSError as exc:  # a read-only cache costs a calibration on restart, nothing more
        log.warning("could not cache the cost model in %s: %s", directory, exc)


def calibrated_cost_model(runner: Any, cache_dir: Path | None, progress: ProgressFn | None = None) -> dict:
    """This runner's measured step-cost table: cached under `cache_dir` (None: always measure)."""
    grid = calibration_grid(runner)
    widest = widest_prefill(runner, grid)
    key = cost_model_key(runner, grid, widest) if cache_dir is not None else ""
    if cache_dir is not None:
        doc = load_cached(cache_dir, key)
        if doc is not None:
            doc.setdefault("meta", {})["cached"] = True
            log.info("step-cost table from the cache (%s/%s.json)", cache_dir, key)
            return doc
    t0 = time.perf_counter()
    doc = profile_runner(runner, *grid, repeats=CALIBRATION_REPEATS, progress=progress, agreement=CALIBRATION_AGREEMENT,
                         widest_prefill=widest)
    doc["meta"]["calibration_seconds"] = round(time.perf_counter() - t0, 3)
    doc["meta"]["cache_key"] = key or None
    busy = _busy()
    doc["meta"]["load_average"] = busy[0]
    log.info("calibrated the step-cost table in %.1f s (%d cells%s)", doc["meta"]["calibration_seconds"],
             len(doc["decode_batch_sizes"]) * len(doc["prefill_tokens"]),
             f"; prefill columns widened to {doc['meta']['widened']}" if doc["meta"]["widened"] else "")
    if cache_dir is not None and busy[1]:
        # Other processes inflated these times: use them now, but do not make every later start
        # of this model on this hardware inherit them.
        log.warning("not caching the step-cost table: load average %.1f over %d CPUs while measuring",
                    busy[0], busy[2])
    elif cache_dir is not None:
        save_cached(cache_dir, key, doc)
    doc["meta"]["cached"] = False
    return doc


def _busy() -> tuple[float | None, bool, int]:
    """(1-minute load average, whether it exceeded the CPUs this process may use, those CPUs)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None, False, cpus
    return round(load, 2), load > cpus, cpus
