"""`magnitude serve` refuses, by name and before serving, what recordTrace and preemptionMode cannot do."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .test_serve_cli import env, serve_cmd


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(serve_cmd("--runner", "simulated", *args), env=env(), capture_output=True, text=True,
                          timeout=60)


def test_record_trace_into_a_missing_directory_exits_2(tmp_path: Path) -> None:
    r = run("--record-trace", str(tmp_path / "nowhere" / "t.jsonl"))
    assert r.returncode == 2 and "recordTrace.path" in r.stderr and "does not exist" in r.stderr


def test_swap_without_swap_blocks_exits_2_naming_both_keys() -> None:
    r = run("--set", "scheduler.preemptionMode=swap")
    assert r.returncode == 2
    assert "scheduler.preemptionMode" in r.stderr and "kvCache.swapBlocks" in r.stderr
