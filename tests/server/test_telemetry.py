"""The telemetry list of issue 16 on a running server: `magnitude serve`'s ring-size and
`--metrics-compat` flags through the real CLI process, and the per-step series (batch occupancy,
prefix cache, KV blocks) over real uvicorn with the simulated runner and the real scheduler.

The real-model side (every series after a mixed trace, scraped by a real Prometheus, and every
dashboard query) is tests/server/test_observability_model.py.
"""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest

from magnitude.server.metrics import VLLM_SERIES, vllm_metric_names

from .conftest import free_port, serve, sim_config, simulated
from .test_serve_cli import env, serve_cmd, wait_ready

ADMIN = {"Authorization": "Bearer adm"}


def chat(content: str, max_tokens: int = 4) -> dict:
    return {"model": "simulated", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def test_ring_sizes_compat_and_service_version_through_the_cli() -> None:
    port = free_port()
    proc = subprocess.Popen(
        serve_cmd("--runner", "simulated", "--port", str(port), "--timeline-ring-size", "2", "--decision-ring-size", "5",
                  "--metrics-compat", "vllm", "--set", "kvCache.numBlocks=256"),
        env={**env(), "MAGNITUDE_ADMIN_TOKEN": "adm", "MAGNITUDE_SERVICE_VERSION": "0123abcdef"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 60)
        ids = []
        for i in range(3):
            r = httpx.post(url + "/v1/chat/completions", json=chat(f"hello {i}"), timeout=30)
            assert r.status_code == 200, r.text
            ids.append(r.headers["X-Request-Id"])
        # three finished requests, a ring of two: the oldest timeline is gone
        assert httpx.get(f"{url}/debug/requests/{ids[0]}", headers=ADMIN).status_code == 404
        assert all(httpx.get(f"{url}/debug/requests/{i}", headers=ADMIN).status_code == 200 for i in ids[1:])
        # each request is at least admit + finish + release: more than five decisions, five kept
        page = httpx.get(url + "/debug/decisions", headers=ADMIN).json()
        assert len(page["decisions"]) == 5 and page["dropped"] > 0 and page["next"] == page["decisions"][-1]["seq"] + 1

        text = httpx.get(url + "/metrics").text
        assert 'service_version="0123abcdef"' in next(line for line in text.splitlines()
                                                     if line.startswith("magnitude_model_info{"))
        names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("vllm:")}
        assert names == vllm_metric_names(), names ^ vllm_metric_names()
        samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line and not line.startswith("#")}
        assert samples['vllm:e2e_request_latency_seconds_count{model_name="simulated"}'] == 3
        assert samples['vllm:generation_tokens_total{model_name="simulated"}'] == 12
        assert samples['vllm:kv_cache_usage_perc{model_name="simulated"}'] == samples["magnitude_kv_cache_usage_ratio"]
        assert samples['vllm:num_requests_waiting{model_name="simulated"}'] == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("args, extra_env, named", [
    (["--timeline-ring-size", "0"], {}, "--timeline-ring-size"),
    (["--decision-ring-size", "-3"], {}, "--decision-ring-size"),
    (["--metrics-compat", "prometheus"], {}, "--metrics-compat"),
    ([], {"MAGNITUDE_METRICS_COMPAT": "vllm2"}, "MAGNITUDE_METRICS_COMPAT"),
])
def test_bad_telemetry_settings_exit_2_naming_them(args: list[str], extra_env: dict[str, str], named: str) -> None:
    r = subprocess.run(serve_cmd("--runner", "simulated", "--port", str(free_port()), *args),
                       env={**env(), **extra_env}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and named in r.stderr, r.stderr


def test_without_compat_there_are_no_vllm_names(sim_server) -> None:  # type: ignore[no-untyped-def]
    assert httpx.post(sim_server.v1 + "/chat/completions", json=chat("hi")).status_code == 200
    assert "vllm:" not in httpx.get(sim_server.url + "/metrics").text
    assert set(VLLM_SERIES) and os.environ.get("MAGNITUDE_METRICS_COMPAT") is None


def test_occupancy_prefix_cache_and_kv_block_series_follow_the_steps() -> None:
    # tokenBudget 64 with 32-token chunks: a 100-odd-token prompt runs as chunks of 32 (half the budget).
    config = sim_config(scheduler__token_budget=64, scheduler__prefill_chunk_size=32, scheduler__max_sequences=4)
    with serve(simulated(config), config) as s:
        prompt = "p" * 120
        for _ in range(2):
            assert httpx.post(s.v1 + "/chat/completions", json=chat(prompt, max_tokens=3)).status_code == 200
        steps = s.metric("magnitude_step_duration_seconds_count")
        assert s.metric("magnitude_batch_token_occupancy_count") == steps > 0
        assert s.metric("magnitude_batch_sequence_occupancy_count") == steps
        # every step had one sequence of four
        assert s.metric("magnitude_batch_sequence_occupancy_sum") == pytest.approx(steps / 4)
        assert s.metric("magnitude_batch_token_occupancy_bucket", le="0.5") == steps  # 32-token chunks or decodes
        assert s.metric("magnitude_batch_token_occupancy_bucket", le="0.4") < steps  # ... and the chunks fill half
        assert s.metric("magnitude_prefix_cache_queries_total") == 2
        assert s.metric("magnitude_prefix_cache_hits_total") == 1  # the second found the first's blocks
        assert s.metric("magnitude_kv_cache_blocks") == 256
        assert s.metric("magnitude_kv_cache_blocks_used") == 0  # all released
        assert s.metric("magnitude_kv_cache_blocks_cached") > 0  # ... and still holding the prompt's prefix
        assert s.metric("magnitude_kv_cache_swap_blocks") >= 0 and s.metric("magnitude_kv_cache_swap_blocks_used") == 0
        assert s.metric("magnitude_kv_cache_allocation_failures_total") == 0
