"""`magnitude profile` writes a cost model the simulator loads, and derives the prefill chunk."""

from __future__ import annotations

import json
from typing import Callable

import pytest

from magnitude.cli.main import main
from magnitude.cli.profile import largest_prefill_chunk, parse_duration
from magnitude.runner.calibration import REFERENCE_ID, profile_runner
from magnitude.sim.cost import load_cost_model


def test_itl_target_parsing():
    assert parse_duration("150ms") == pytest.approx(0.15)
    assert parse_duration("0.2s") == pytest.approx(0.2)
    assert parse_duration("80") == pytest.approx(0.08)


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's own exit for a bad flag value
        main(["profile", "--out", "x.json", "--itl-target", "fast"])
    assert e.value.code == 2
    assert "--itl-target" in capsys.readouterr().err


def test_the_kv_cache_dtype_reaches_the_runner_and_a_bad_one_exits_2(monkeypatch, tmp_path, capsys):
    """A profile measures the pool the deployment serves (`kvCache.dtype`): the flag is the runner's."""
    import magnitude.runner

    seen = {}

    class _Stop(Exception):
        pass

    def fake_runner(*args, **kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(magnitude.runner, "ModelRunner", fake_runner)
    with pytest.raises(_Stop):
        main(["profile", "--out", str(tmp_path / "c.json"), "--quantization", "w4a16", "--kv-cache-dtype", "float32"])
    assert seen["kv_cache_dtype"] == "float32" and seen["quantization"] == "w4a16"
    with pytest.raises(SystemExit) as e:
        main(["profile", "--out", str(tmp_path / "c.json"), "--kv-cache-dtype", "bfloat16"])
    assert e.value.code == 2 and "--kv-cache-dtype" in capsys.readouterr().err


def test_largest_chunk_is_derived_from_the_table():
    doc = {"decode_batch_sizes": [0, 8], "prefill_tokens": [0, 100],
           "seconds": [[0.01, 0.11], [0.05, 0.15]]}
    # With 8 decodes the step costs 0.05 + 0.001 * p: under 0.1 s up to p = 50.
    assert largest_prefill_chunk(doc, 8, 0.1) == 50
    assert largest_prefill_chunk(doc, 8, 0.04) == 0


@pytest.mark.model
def test_profile_of_the_real_runner_loads_as_a_cost_model(runner, tmp_path):
    doc = profile_runner(runner, [0, 2], [0, 16], context=20, repeats=1)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(doc))
    model = load_cost_model(str(path))
    assert model.name == "table"
    secs = doc["seconds"]
    assert all(s > 0 for row in secs for s in row)
    assert secs[1][1] > secs[0][0]  # two decodes plus a chunk take longer than an empty step


class _ScriptedRunner:
    """A runner whose step times are scripted per grid cell (decodes, prefill tokens), pass by
    pass, and which counts the steps it ran: no model, no timing noise. The reference step between
    cells takes `reference` seconds, times `speed(n)` for the n-th step run (a host whose speed drifts)."""

    block_size, num_blocks, num_swap_blocks = 16, 64, 0
    model_name, device, dtype, quantization = "scripted", "cpu", "float32", "none"

    def __init__(self, script: dict[tuple[int, int], list[float]], reference: float = 0.010,
                 speed: Callable[[int], float] = lambda n: 1.0) -> None:
        self.script = script
        self.reference = reference
        self.speed = speed
        self.ran: dict[tuple[int, int], int] = {}
        self.references = 0
        self.steps = 0

    def execute(self, plan):
        from types import SimpleNamespace

        if plan.step_id == 0:  # the unmeasured first run of the largest cell
            return SimpleNamespace(duration_s=1.0)
        self.steps += 1
        if all(s.request_id.startswith(REFERENCE_ID) for s in plan.seqs):
            self.references += 1
            return SimpleNamespace(duration_s=self.reference * self.speed(self.steps))
        cell = (sum(1 for s in plan.seqs if s.request_id.startswith("d")),
                sum(len(s.token_ids) for s in plan.seqs if s.request_id == "p"))
        n = self.ran.get(cell, 0)
        self.ran[cell] = n + 1
        return SimpleNamespace(duration_s=self.script[cell][n] * self.speed(self.steps))


def test_the_engines_third_pass_runs_only_where_the_first_two_disagree():
    """With `agreement` (the engine's calibration), a cell whose first two passes agree within it is
    not measured a third time (its median could only move within their band), one that disagrees is,
    and takes the median of three; without it every pass runs (`magnitude profile --repeats`)."""
    # A reference of 0.010 s throughout: the relative times are the scripted ones over it.
    script = {(1, 0): [0.010, 0.0104, 9.0], (0, 16): [0.040, 0.080, 0.041], (1, 16): [0.050, 0.051, 9.0]}
    runner = _ScriptedRunner(script)
    doc = profile_runner(runner, [0, 1], [0, 16], context=20, repeats=3, attention=False, agreement=0.05)
    assert runner.ran == {(1, 0): 2, (0, 16): 3, (1, 16): 2}
    assert doc["meta"]["passes"] == 7
    secs = doc["seconds"]
    assert secs[1][0] == pytest.approx(0.0102) and secs[0][1] == pytest.approx(0.041)
    assert secs[1][1] == pytest.approx(0.0505)
    every = _ScriptedRunner(script)
    doc = profile_runner(every, [0, 1], [0, 16], context=20, repeats=3, attention=False)
    assert every.ran == {(1, 0): 3, (0, 16): 3, (1, 16): 3} and doc["seconds"][1][1] == pytest.approx(0.051)
    assert every.references == 9 + 1  # one before the first cell, one after each


def test_cells_are_timed_against_the_reference_beside_them():
    """A host that runs everything twice as slowly from some step on (a shared machine's speed
    drifts over seconds): each cell over the reference steps around it keeps the cells' true
    proportions, in seconds of the median reference. Cells taken at face value would not: the
    chunk measured at half speed would cost 8x the decode instead of 4x."""
    script = {(1, 0): [0.010], (0, 16): [0.040], (1, 16): [0.050]}
    # The order run: reference, (0, 16), reference, (1, 0), reference, (1, 16), reference; half
    # speed from the fourth step, the (1, 0) cell, on.
    runner = _ScriptedRunner(script, reference=0.010, speed=lambda step: 1.0 if step < 4 else 2.0)
    doc = profile_runner(runner, [0, 1], [0, 16], context=20, repeats=1, attention=False)
    secs = doc["seconds"]
    # References 0.010, 0.010, 0.020, 0.020: the median is 0.015 s.
    assert doc["meta"]["reference_step_seconds"] == pytest.approx(0.015)
    assert secs[0][1] == pytest.approx(4 * 0.015) and secs[1][1] == pytest.approx(5 * 0.015)
    # The cell the change fell on is over the mean of a full- and a half-speed reference.
    assert secs[1][0] == pytest.approx(4 / 3 * 0.015)


class _PoolReadingRunner:
    """Records the pool blocks each step reads (a sequence's context: its blocks before its first
    new token) and the blocks written for measurements (`materialize_kv_blocks`)."""

    block_size, num_blocks, num_swap_blocks, max_model_len = 16, 4096, 0, 8192
    model_name, device, dtype, quantization = "reading", "cpu", "float32", "none"

    def __init__(self) -> None:
        self.written = 0
        self.most_read = 0

    def materialize_kv_blocks(self, n: int) -> None:
        self.written = max(self.written, n)

    def execute(self, plan):
        from types import SimpleNamespace

        for s in plan.seqs:
            context_blocks = s.block_table[:-(-s.start_position // self.block_size)] if s.start_position else []
            if context_blocks:
                assert max(context_blocks) < self.written, f"{s.request_id} reads block {max(context_blocks)} unwritten"
                self.most_read = max(self.most_read, max(context_blocks) + 1)
        return SimpleNamespace(duration_s=0.01 + 1e-6 * plan.attention_load().contexts + 1e-5 * plan.num_tokens)


def test_calibration_reads_only_blocks_it_wrote_and_writes_no_more_than_it_reads():
    """Unwritten CPU pool pages read as the kernel's cached zero page, which times any context as free:
    the start-up grid and the attention figures write what they read first (and only about that:
    the written pages are memory the process holds while it measures)."""
    from magnitude.runner.calibration import CALIBRATION_CONTEXT, CALIBRATION_DECODES, CALIBRATION_PREFILLS

    runner = _PoolReadingRunner()
    doc = profile_runner(runner, list(CALIBRATION_DECODES), list(CALIBRATION_PREFILLS), CALIBRATION_CONTEXT, repeats=1)
    assert runner.most_read > 0
    assert runner.written <= runner.most_read + 20  # the grid's prefill blocks besides the contexts read
    assert doc["per_decode_context_token"] == pytest.approx(1e-6)


class _CostRunner:
    """A runner whose step takes `fixed` + `per_decode` a decode + `per_token` a prompt token (the
    reference step too), and which counts the cells it ran."""

    block_size, num_blocks, num_swap_blocks, max_model_len = 16, 4096, 0, 8192
    model_name, device, dtype, quantization = "costed", "cpu", "float32", "none"

    def __init__(self, fixed: float, per_token: float, per_decode: float = 0.002) -> None:
        self.fixed, self.per_token, self.per_decode = fixed, per_token, per_decode
        self.ran: dict[tuple[int, int], int] = {}

    def execute(self, plan):
        from types import SimpleNamespace

        decodes = sum(1 for s in plan.seqs if not s.request_id == "p")
        tokens = sum(len(s.token_ids) for s in plan.seqs if s.request_id == "p")
        if plan.step_id and not all(s.request_id.startswith(REFERENCE_ID) for s in plan.seqs):
            self.ran[(decodes, tokens)] = self.ran.get((decodes, tokens), 0) + 1
        return SimpleNamespace(duration_s=self.fixed + self.per_decode * decodes + self.per_token * tokens)


def test_prefill_columns_are_widened_while_the_efficient_step_lies_past_them():
    """50 ms a step and 0.2 ms a prompt token: 90% of the best rate takes 2,250 tokens, past the
    grid's 256 (where 64 tokens run at 0.40 of 256's rate), so 512 is measured, then 1,024 (512 at
    0.84 of its rate); 2,048 would take 460 ms, past twice reading pace: nothing more, with room for
    it. Each column at every decode row and as many passes as the grid's cells; within
    `widest_prefill`, and not at all without it (`magnitude profile`: the columns asked for).
    Progress never goes back, holds the widening's share from the start and reaches 1."""
    runner = _CostRunner(fixed=0.050, per_token=0.0002)
    seen: list[float] = []
    doc = profile_runner(runner, [0, 1, 4], [0, 16, 64, 256], context=20, repeats=2, attention=False,
                         widest_prefill=2048, progress=seen.append)
    assert doc["prefill_tokens"] == [0, 16, 64, 256, 512, 1024] and doc["meta"]["widened"] == [512, 1024]
    assert all(runner.ran[(d, p)] == 2 for d in (0, 1, 4) for p in (512, 1024))
    # Each cell over the reference (one decode) times the median reference: the step's own seconds.
    assert doc["seconds"][2][5] == pytest.approx(0.050 + 4 * 0.002 + 1024 * 0.0002)
    assert seen == sorted(seen) and seen[-1] == pytest.approx(1.0)
    # The grid's 12 cells x 2 passes of the 12 + 3 x 3 possible columns: 24/42 before any widening.
    assert pytest.approx(24 / 42) in seen and seen[-2] == pytest.approx(36 / 42)
    # 0.5 ms a token: 1,024 tokens would take 562 ms, so only 512 is measured (90% still at 900).
    dear = profile_runner(_CostRunner(0.050, 0.0005), [0, 1], [0, 16, 64, 256], context=20, repeats=1,
                          attention=False, widest_prefill=2048)
    assert dear["meta"]["widened"] == [512]
    capped = profile_runner(_CostRunner(0.050, 0.0002), [0, 1], [0, 16, 64, 256], context=20, repeats=1,
                            attention=False, widest_prefill=512)
    assert capped["prefill_tokens"] == [0, 16, 64, 256, 512]
    unasked = profile_runner(_CostRunner(0.050, 0.0002), [0, 1], [0, 16, 64, 256], context=20, repeats=1,
                             attention=False)
    assert unasked["prefill_tokens"] == [0, 16, 64, 256] and unasked["meta"]["widened"] == []
    # 2 ms a step: 90% of the rate at 36 tokens, within the grid: nothing measured past it.
    near = _CostRunner(fixed=0.002, per_token=0.0005)
    doc = profile_runner(near, [0, 1], [0, 16, 64, 256], context=20, repeats=1, attention=False, widest_prefill=1024)
    assert doc["prefill_tokens"] == [0, 16, 64, 256] and not any(p > 256 for _, p in near.ran)


def test_the_widest_column_fits_the_model_length_and_the_pool():
    from magnitude.runner.calibration import CALIBRATION_WIDEST_PREFILL, blocks_needed, widest_prefill

    grid = ([0, 1, 4, 16], [0, 16, 64, 256], 256)
    runner = _CostRunner(0.05, 0.0005)
    assert widest_prefill(runner, grid) == CALIBRATION_WIDEST_PREFILL == 1024
    runner.max_model_len = 1000
    assert widest_prefill(runner, grid) == 512
    runner.max_model_len = 8192
    runner.num_blocks = blocks_needed(grid[0], [*grid[1], 512], grid[2], runner.block_size)
    assert widest_prefill(runner, grid) == 512
