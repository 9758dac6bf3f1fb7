"""`magnitude serve --runner simulated` as a real process: config errors, graceful SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from .conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "magnitude.cli.main", "serve", *args]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'server'}:{ROOT / 'operator'}"}


def test_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("scheduler:\n  tokenBudget: -4\n")
    r = subprocess.run(serve_cmd("--runner", "simulated", "--config", str(cfg)), env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "tokenBudget" in r.stderr
    r = subprocess.run(serve_cmd("--runner", "simulated", "--cost-model", "/nonexistent.json"), env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cost-model" in r.stderr


def test_sigterm_finishes_in_flight_work_and_exits_0() -> None:
    port = free_port()
    proc = subprocess.Popen(
        serve_cmd("--runner", "simulated", "--port", str(port), "--shutdown-grace", "20", "--set", "kvCache.numBlocks=128"),
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            pytest.fail("simulated server did not become ready")
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="simulated", messages=[{"role": "user", "content": "hi"}], max_tokens=60, stream=True
        )
        chunks = iter(stream)
        first = next(chunks)
        assert first.choices[0].delta.role == "assistant"
        proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
        text = "".join(c.choices[0].delta.content or "" for c in rest if c.choices)
        assert len(text) == 60  # byte tokenizer: one character per token
        assert rest[-1].choices[0].finish_reason == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
