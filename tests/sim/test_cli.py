"""`magnitude trace` and `magnitude simulate` end to end, in-process, plus bad input: exit code 2,
a message naming the line or key, and nothing half-written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from magnitude.cli.main import main

P_KEYS = {"p50", "p90", "p99", "max", "mean"}
PRACTICE = [
    {"id": "A", "arrival": 0, "prompt_tokens": 24, "output_tokens": 4},
    {"id": "B", "arrival": 0, "prompt_tokens": 4, "output_tokens": 8},
    {"id": "C", "arrival": 1, "prompt_tokens": 8, "output_tokens": 4, "priority_class": "interactive"},
    {"id": "D", "arrival": 2, "prompt_tokens": 20, "output_tokens": 2, "cancel_at": 3.0},
]


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_trace_then_simulate_json_follows_the_report_contract(tmp_path, capsys) -> None:
    trace = tmp_path / "mixed.jsonl"
    assert main(["trace", "mixed", "--n", "60", "--seed", "3", "-o", str(trace)]) == 0
    assert len(trace.read_text().splitlines()) == 60
    capsys.readouterr()
    assert main(["simulate", str(trace), "--json", "--set", "scheduler.tokenBudget=256"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"config", "summary", "tenants", "classes", "requests", "steps", "events"}
    assert report["config"]["scheduler"]["tokenBudget"] == 256
    s = report["summary"]
    assert set(s) >= {"requests", "finished", "rejected", "cancelled", "timed_out", "output_tokens", "duration",
                      "throughput_tokens_per_s", "preemptions", "ttft", "itl", "queue_time", "e2e"}
    assert all(set(s[k]) == P_KEYS for k in ("ttft", "itl", "queue_time", "e2e"))
    assert s["requests"] == 60 == len(report["requests"])
    assert all("max_wait" in t for t in report["tenants"].values())
    assert set(report["requests"][0]) == {"id", "tenant", "priority_class", "arrival", "admitted", "first_token",
                                          "finished", "status", "reason", "output_tokens", "preemptions"}
    assert set(report["steps"][0]) == {"t", "duration", "decode", "prefill", "preempted", "kv_used_blocks",
                                       "kv_total_blocks", "waiting", "running"}
    assert set(report["events"][0]) == {"t", "kind", "request", "reason"}


def test_unit_cost_times_are_steps_and_unreached_times_are_null(tmp_path, capsys) -> None:
    trace = write_lines(tmp_path / "t.jsonl", PRACTICE)
    args = ["simulate", str(trace), "--json", "--cost-model", "unit", "--set", "scheduler.tokenBudget=16",
            "--set", "scheduler.prefillChunkSize=8", "--set", "kvCache.blockSize=1", "--set", "kvCache.numBlocks=40"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    req = {r["id"]: r for r in report["requests"]}
    assert req["B"]["first_token"] == 1.0 and req["B"]["admitted"] == 0.0
    assert (req["D"]["status"], req["D"]["admitted"], req["D"]["first_token"]) == ("cancelled", None, None)
    assert all(s["duration"] == 1.0 for s in report["steps"])


def bad(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_malformed_trace_line_names_the_line(tmp_path, capsys) -> None:
    trace = write_lines(tmp_path / "t.jsonl", [PRACTICE[0], PRACTICE[1], '{"id": "x", "arrival": 0,'])
    err = bad(capsys, ["simulate", str(trace)])
    assert f"{trace}:3: not valid JSON" in err


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ({"id": "x", "arrival": 0, "prompt_tokens": 0, "output_tokens": 1}, ":2: prompt_tokens:"),
        ({"id": "x", "arrival": -1, "prompt_tokens": 1, "output_tokens": 1}, ":2: arrival:"),
        ({"id": "x", "arrival": 0, "prompt_tokens": 1}, ":2: output_tokens: Field required"),
        ({"id": "x", "arival": 0, "prompt_tokens": 1, "output_tokens": 1}, "arival: Extra inputs are not permitted"),
        ({"id": "A", "arrival": 0, "prompt_tokens": 1, "output_tokens": 1}, ":2: id: duplicate id 'A'"),
        ({"id": "x", "arrival": 0, "prompt_tokens": 1, "output_tokens": 1, "priority_class": "gold"},
         ":2: priority_class: unknown priority class 'gold'"),
    ],
)
def test_bad_trace_fields_name_the_line_and_key(tmp_path, capsys, line, expected) -> None:
    trace = write_lines(tmp_path / "t.jsonl", [PRACTICE[0], line])
    assert expected in bad(capsys, ["simulate", str(trace)])


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["scheduler.tokenBudget=-4"], "scheduler.tokenBudget: Input should be greater than or equal to 1"),
        (["scheduler.tokenBudgt=16"], "unknown key 'tokenBudgt' under scheduler"),
        (["schedular.tokenBudget=16"], "unknown key 'schedular' under the top level"),
        (["scheduler.preemptionMode=evict"], "scheduler.preemptionMode"),
        (["scheduler.tokenBudget"], "expected KEY=VALUE"),
        (["scheduler.priorityClasses.5.priority=1"], "'5' is not an index of the list (length 3)"),
        (["scheduler.defaultPriorityClass=gold"], "defaultPriorityClass: 'gold' is not one of the priorityClasses"),
        (["draftModel.method=ngram"], "draftModel: give the acceptance to simulate"),
        (["draftModel.method=ngram", "draftModel.source=x"], "apply to method draft only"),
    ],
)
def test_bad_overrides_name_the_key(tmp_path, capsys, sets, expected) -> None:
    trace = write_lines(tmp_path / "t.jsonl", PRACTICE)
    argv = ["simulate", str(trace)]
    for s in sets:
        argv += ["--set", s]
    assert expected in bad(capsys, argv)


def test_bad_config_file_names_the_key(tmp_path, capsys) -> None:
    trace = write_lines(tmp_path / "t.jsonl", PRACTICE)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("scheduler:\n  tokenBudget: 16\n  maxSequencez: 4\n")
    assert "scheduler.maxSequencez: Extra inputs are not permitted" in bad(capsys, ["simulate", str(trace), "--config", str(cfg)])
    cfg.write_text("admission:\n  maxQueuedRequests: 0\n")
    assert "admission.maxQueuedRequests" in bad(capsys, ["simulate", str(trace), "--config", str(cfg)])


def test_bad_cost_model_is_a_usage_error(tmp_path, capsys) -> None:
    trace = write_lines(tmp_path / "t.jsonl", PRACTICE)
    assert "--cost-model nope" in bad(capsys, ["simulate", str(trace), "--cost-model", "nope"])
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"kind": "linear", "bsae": 0.01}))
    assert "unknown key(s) ['bsae']" in bad(capsys, ["simulate", str(trace), "--cost-model", str(cost)])


def test_nothing_half_written_on_bad_input(tmp_path, capsys) -> None:
    trace = write_lines(tmp_path / "t.jsonl", [PRACTICE[0], "not json"])
    out = tmp_path / "report"
    bad(capsys, ["simulate", str(trace), "--report", str(out)])
    assert not out.exists()
    target = tmp_path / "trace.jsonl"
    assert main(["trace", "burst", "--n", "5", "-o", str(target)]) == 0
    before = target.read_text()
    assert main(["trace", "burst", "--n", "5", "-o", str(tmp_path / "missing" / "t.jsonl")]) == 2
    assert target.read_text() == before and list(tmp_path.glob(".trace*")) == []


def test_bad_trace_options_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["trace", "burst", "--n", "-3"])
    assert e.value.code == 2 and "--n" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["trace", "no-such-scenario"])
    assert e.value.code == 2


def test_report_dir_has_report_and_plots(tmp_path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["trace", "tenants", "--n", "80", "-o", str(trace)]) == 0
    out = tmp_path / "rep"
    assert main(["simulate", str(trace), "--report", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["queue_time_by_tenant.png", "report.json", "timeline.png", "ttft_by_class.png"]
    assert json.loads((out / "report.json").read_text())["summary"]["requests"] == 80
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert "tenant heavy" in capsys.readouterr().out


def test_simulate_never_imports_torch_or_servers(tmp_path) -> None:
    trace = write_lines(tmp_path / "t.jsonl", PRACTICE)
    code = (
        "import sys; from magnitude.cli.main import main; rc = main(['simulate', sys.argv[1]]);"
        "heavy = [m for m in ('torch', 'fastapi', 'kopf', 'prometheus_client', 'matplotlib') if m in sys.modules];"
        "assert rc == 0 and not heavy, heavy"
    )
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": f"{root / 'server'}:{root / 'operator'}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code, str(trace)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_command_whose_module_is_missing_fails_alone(monkeypatch, capsys) -> None:
    from magnitude.cli import main as cli_main

    monkeypatch.setitem(cli_main.COMMANDS, "ghost", ("magnitude.cli.no_such_module", "not installed"))
    assert main(["ghost"]) == 2
    assert "cannot run `ghost`" in capsys.readouterr().err
    assert main(["trace", "burst", "--n", "2"]) == 0  # the others still work
