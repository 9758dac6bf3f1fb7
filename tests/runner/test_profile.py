"""`magnitude profile` writes a cost model the simulator loads, and derives the prefill chunk."""

from __future__ import annotations

import json

import pytest

from magnitude.cli.main import main
from magnitude.cli.profile import largest_prefill_chunk, parse_duration
from magnitude.runner.calibration import profile_runner
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
