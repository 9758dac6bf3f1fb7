"""Start-up calibration on the real runner: the table `magnitude serve` measures while loading (phase
`calibrating`), in the simulator's format, cached in the model cache by hardware and weights so a
restart reuses it. The grid is shrunk here (the module constants) to keep the test short; the
measuring function is the one `magnitude profile` uses."""

from __future__ import annotations

import json

import pytest

from magnitude.runner import calibration
from magnitude.sim.cost import TableCost, cost_model_from_document

pytestmark = pytest.mark.model


@pytest.fixture
def small_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    # A quiet machine, whatever the test host's load: a busy one is its own test below.
    monkeypatch.setattr(calibration, "_busy", lambda: (0.5, False, 2))
    # 32 decodes beside a 16-token chunk triple its rows: a difference no host's noise hides (with
    # 2 decodes a CI run measured both cells alike, and the table's monotone clamp made them equal).
    monkeypatch.setattr(calibration, "CALIBRATION_DECODES", (0, 32))
    monkeypatch.setattr(calibration, "CALIBRATION_PREFILLS", (0, 16))
    monkeypatch.setattr(calibration, "CALIBRATION_CONTEXT", 24)
    monkeypatch.setattr(calibration, "CALIBRATION_REPEATS", 1)


def test_measured_once_then_read_from_the_cache(runner, tmp_path, small_grid) -> None:
    seen: list[float] = []
    doc = calibration.calibrated_cost_model(runner, tmp_path, seen.append)
    assert seen and seen[-1] == pytest.approx(1.0)
    assert doc["meta"]["cached"] is False and doc["meta"]["device"] == "cpu"
    cost = cost_model_from_document(doc)
    assert isinstance(cost, TableCost)
    rows = doc["seconds"]
    assert all(a <= b for row in rows for a, b in zip(row, row[1:]))  # non-decreasing along each axis
    assert all(a <= b for a, b in zip(rows[0], rows[1]))
    assert rows[1][1] > rows[0][1] > 0  # 32 decodes and a chunk take longer than the chunk alone
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and files[0].stem == doc["meta"]["cache_key"]

    again: list[float] = []
    cached = calibration.calibrated_cost_model(runner, tmp_path, again.append)
    assert again == [] and cached["meta"]["cached"] is True  # nothing measured on a restart
    assert cached["seconds"] == doc["seconds"]

    # The key covers what the times depend on: another grid (or dtype, threads, ...) measures anew.
    calibration.CALIBRATION_PREFILLS = (0, 8)
    assert calibration.calibrated_cost_model(runner, tmp_path)["meta"]["cached"] is False
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_table_measured_on_a_busy_machine_is_used_but_not_kept(runner, tmp_path, small_grid, monkeypatch) -> None:
    monkeypatch.setattr(calibration, "_busy", lambda: (9.5, True, 2))
    doc = calibration.calibrated_cost_model(runner, tmp_path)
    assert doc["meta"]["load_average"] == 9.5 and doc["meta"]["cached"] is False
    assert list(tmp_path.glob("*.json")) == []


def test_a_torn_cache_file_is_measured_again(runner, tmp_path, small_grid) -> None:
    doc = calibration.calibrated_cost_model(runner, tmp_path)
    (tmp_path / f"{doc['meta']['cache_key']}.json").write_text('{"kind": "tab')
    assert calibration.calibrated_cost_model(runner, tmp_path)["meta"]["cached"] is False


def test_serve_calibrates_while_loading_and_keeps_the_table(runner, tmp_path, small_grid, monkeypatch) -> None:
    """What `magnitude serve`'s loader does after loading the real runner without --cost-model:
    phase `calibrating` from 0 to 1, the table on the runner for the engine, the file under
    $MAGNITUDE_CACHE/cost-models."""
    from magnitude.cli.serve import calibrate

    monkeypatch.setenv("MAGNITUDE_CACHE", str(tmp_path))
    monkeypatch.delattr(runner, "cost_model_document", raising=False)
    phases: list[tuple[str, float]] = []
    calibrate(runner, lambda phase, fraction, detail=None: phases.append((phase, fraction)))
    assert {p for p, _ in phases} == {"calibrating"}
    assert phases[0][1] == 0.0 and phases[-1][1] == pytest.approx(1.0)
    assert runner.cost_model_document["kind"] == "table"
    [saved] = (tmp_path / "cost-models").glob("*.json")
    assert json.loads(saved.read_text())["seconds"] == runner.cost_model_document["seconds"]
    del runner.cost_model_document  # the session's runner is shared
