"""`magnitude serve` as a real process: config errors, graceful SIGTERM, quantization flags refused before loading."""

from __future__ import annotations

import json
import os
import re
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


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"server on {url} did not become ready in {timeout}s")


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
        wait_ready(url, proc, 60)
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


def test_the_serving_process_freezes_what_loading_left_for_the_garbage_collector() -> None:
    """A full collection over what loading leaves (torch, transformers, the model: ~445,000 objects
    for SmolLM2) holds the GIL for ~230 ms, a stall in every stream; `magnitude serve` freezes it
    once loaded (server/async_engine.py freeze_loaded_heap), and says so."""
    port = free_port()
    proc = subprocess.Popen(serve_cmd("--runner", "simulated", "--port", str(port), "--log-level", "info",
                                      "--set", "kvCache.numBlocks=64"),
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(url := f"http://127.0.0.1:{port}", proc, 60)
        assert httpx.post(url + "/v1/completions", json={"model": "simulated", "prompt": "hi", "max_tokens": 4},
                          timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    frozen = [line for line in out.splitlines() if "the garbage collector no longer scans them" in line]
    assert len(frozen) == 1, out[-2000:]
    assert int(frozen[0].split("froze the ")[1].split()[0]) > 10_000


def test_engines_in_a_test_process_leave_the_garbage_collector_alone() -> None:
    """Only the serving process freezes: one that starts engines again and again would keep each
    frozen heap's cycles."""
    import gc

    from .conftest import serve, sim_config, simulated

    config = sim_config()
    with serve(simulated(config), config):
        assert gc.get_freeze_count() == 0


def test_real_runner_refuses_a_builtin_cost_model() -> None:
    """The built-in models describe no real hardware: the real runner calibrates, or takes a measured table."""
    r = subprocess.run(serve_cmd("--cost-model", "linear"), env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--cost-model linear" in r.stderr and "calibrate" in r.stderr


def test_itl_target_on_the_unit_model_exits_2() -> None:
    """The unit model counts steps, not seconds: an ITL target cannot be kept on it."""
    r = subprocess.run(serve_cmd("--runner", "simulated", "--cost-model", "unit", "--set", "scheduler.itlTargetMs=100"),
                       env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "itlTargetMs" in r.stderr and "unit" in r.stderr


def test_cost_model_file_derives_the_limits_and_is_served(tmp_path: Path) -> None:
    """`--cost-model FILE.json` (the `magnitude profile` format): the null tokenBudget and
    prefillChunkSize are derived from it for itlTargetMs, reported on /readyz and /metrics, and the
    file is what GET /debug/cost-model returns (admin token only)."""
    cost = tmp_path / "cost.json"
    doc = {"kind": "table", "decode_batch_sizes": [1, 64], "prefill_tokens": [1, 1000],
           "seconds": [[0.01, 0.11], [0.05, 0.15]], "meta": {"device": "cpu"}}
    cost.write_text(json.dumps(doc))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(serve_cmd("--runner", "simulated", "--cost-model", str(cost), "--port", str(port),
                                      "--set", "scheduler.itlTargetMs=100"),
                            env={**env(), "MAGNITUDE_ADMIN_TOKEN": "adm"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, proc, 60)
        # A step of B prefill tokens alone (0 decodes, extrapolated from the rows) costs
        # 0.009365 + 0.1 * (B - 1) / 999 s: within 0.1 s up to B = 906. With 8 decodes the row
        # starts at 0.014444: a chunk of up to 855 tokens fits. (Until served steps are judged the
        # scheduler bounds each step at 1.5x the table, a cold start's margin, so the first steps are
        # smaller than these caps.)
        assert httpx.get(url + "/readyz").json()["scheduler"] == {
            "tokenBudget": 906, "prefillChunkSize": 855, "itlTargetMs": 100.0, "source": "derived"}
        metrics = httpx.get(url + "/metrics").text
        assert 'magnitude_scheduler_token_budget{source="derived"} 906.0' in metrics
        assert 'magnitude_scheduler_prefill_chunk_tokens{source="derived"} 855.0' in metrics
        assert 'magnitude_scheduler_itl_target_seconds{source="derived"} 0.1' in metrics
        assert httpx.get(url + "/debug/cost-model").status_code == 401
        # The file, with what served steps took against it so far (none yet).
        served = {**doc, "meta": {"device": "cpu", "servedOverPredicted": 1.0, "servedFixedSeconds": 0.0,
                                  "servedPerDecodeSeconds": 0.0, "servedNoiseMargin": 0.0,
                                  "servedMarginHistory": [], "servedLineHistory": [], "servedSteps": 0,
                                  "servedPrefillOnlyOverPredicted": None, "servedPrefillOnlySteps": 0}}
        assert httpx.get(url + "/debug/cost-model", headers={"Authorization": "Bearer adm"}).json() == served
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_engine_learns_what_its_steps_take_and_reports_it_for_replays(tmp_path: Path) -> None:
    """The simulated runner sleeps twice the table's time (`--time-scale 2`, a stand-in for a host
    whose served steps run over the calibration): after a few requests GET /debug/cost-model says
    the served steps took about 2x the table, decoding steps and prefill-only ones alike, and the
    document loads as the served model; the
    margin's history is dated on the clock the recorded trace counts from."""
    from magnitude.sim.cost import ServedCost, cost_model_from_document

    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"kind": "table", "decode_batch_sizes": [1, 64], "prefill_tokens": [1, 1000],
                                "seconds": [[0.01, 0.11], [0.05, 0.15]]}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    recorded = tmp_path / "recorded.jsonl"
    proc = subprocess.Popen(serve_cmd("--runner", "simulated", "--cost-model", str(cost), "--port", str(port),
                                      "--time-scale", "2", "--set", "scheduler.itlTargetMs=100",
                                      "--record-trace", str(recorded)),
                            env={**env(), "MAGNITUDE_ADMIN_TOKEN": "adm"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, proc, 60)
        for i in range(5):
            r = httpx.post(url + "/v1/completions", json={"model": "simulated", "prompt": f"hello {i} " * 20,
                                                          "max_tokens": 12}, timeout=60)
            assert r.status_code == 200, r.text
        doc = httpx.get(url + "/debug/cost-model", headers={"Authorization": "Bearer adm"}).json()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    meta = doc["meta"]
    print(f"\nserved steps {meta['servedSteps']}: {meta['servedFixedSeconds']} s + {meta['servedOverPredicted']} x the table")
    assert meta["servedSteps"] >= 30
    model = cost_model_from_document(doc)
    assert isinstance(model, ServedCost) and model.factor == meta["servedOverPredicted"]
    assert model.fixed_s == meta["servedFixedSeconds"]
    # The steps served (one decode each, 10 ms in the table) took twice the table, plus what the
    # loop and the HTTP side add to each step (a few ms at most). All of one size, they cannot tell
    # a fixed cost from a scale: the fit keeps the table's scale and the excess is the fixed cost.
    assert 1.9 <= model.seconds_for(1, 0) / model.model.seconds_for(1, 0) <= 3.0
    assert meta["servedOverPredicted"] == 1.0
    # The first refit (the 16th judged step) opens the history, in seconds from the engine's start,
    # as the recording's arrivals are: within the requests' span on that clock.
    arrivals = sorted(json.loads(line)["arrival"] for line in recorded.read_text().splitlines())
    print(f"arrivals {arrivals}, margin history {meta['servedMarginHistory']}")
    assert len(arrivals) == 5 and meta["servedMarginHistory"]
    assert arrivals[0] <= meta["servedMarginHistory"][0][0] <= arrivals[-1]
    assert list(model.margin_history) == [tuple(e) for e in meta["servedMarginHistory"]]
    # Each prompt ran alone (one request at a time): five prefill-only steps, judged to the next
    # step's start, at twice the table and what the loop adds, which a replay prices them by.
    print(f"prefill-only steps {meta['servedPrefillOnlySteps']}: {meta['servedPrefillOnlyOverPredicted']} x the table")
    assert meta["servedPrefillOnlySteps"] == 5
    assert 1.9 <= meta["servedPrefillOnlyOverPredicted"] <= 3.0
    assert model.prefill_only_factor == meta["servedPrefillOnlyOverPredicted"]
    # The line's history opens at the SERVED_EARLY_STEPS-th judged step (the ratio of those steps'
    # seconds, about 2x the table), on the same clock.
    print(f"line history {meta['servedLineHistory']}")
    assert arrivals[0] <= meta["servedLineHistory"][0][0] <= arrivals[-1]
    assert 1.5 <= meta["servedLineHistory"][0][3] <= 3.0
    assert list(model.line_history) == [tuple(e) for e in meta["servedLineHistory"]]


def test_derived_limits_follow_what_served_steps_take(tmp_path: Path) -> None:
    """Limits derived from the table are derived again from served step times once enough steps are
    judged: served steps that take twice the table (`--time-scale 2`, the simulated runner standing
    in for a host where the HTTP side shares the cores), all of one size, are learned as the table
    plus a fixed cost per step, and the limits are what that served model derives (the target grows
    by the fixed cost over the table's, which the start's carried with a cold start's margin); /readyz
    and /metrics say so. The explicit peer keeps its limits."""
    from magnitude.policy.load import resolve_config
    from magnitude.sim.cost import (SERVED_COLD_MARGIN, SERVED_DERIVE_STEPS, SERVED_MIN_STEPS, SchedulerLimits,
                                    ServedBound, cost_model_from_document, derive_scheduler_limits, limits_moved,
                                    load_cost_model)

    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"kind": "table", "decode_batch_sizes": [1, 64], "prefill_tokens": [1, 1000],
                                "seconds": [[0.01, 0.11], [0.05, 0.15]]}))
    readyz, metrics, served = {}, {}, {}
    for name, sets in (("derived", []), ("set", ["--set", "scheduler.tokenBudget=256",
                                                 "--set", "scheduler.prefillChunkSize=128"])):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(serve_cmd("--runner", "simulated", "--cost-model", str(cost), "--port", str(port),
                                          "--time-scale", "2", *sets),
                                env={**env(), "MAGNITUDE_ADMIN_TOKEN": "adm"}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            wait_ready(url, proc, 60)
            before = httpx.get(url + "/readyz").json()["scheduler"]
            # One stream decodes a token a step: enough judged steps to derive again at the 16th and
            # every SERVED_DERIVE_STEPS after (so the last derivation's line is the end's), and a few more.
            r = httpx.post(url + "/v1/completions", json={"model": "simulated", "prompt": "hello " * 20,
                                                          "max_tokens": SERVED_MIN_STEPS + SERVED_DERIVE_STEPS + 8},
                           timeout=120)
            assert r.status_code == 200, r.text
            after = httpx.get(url + "/readyz").json()["scheduler"]
            metrics[name] = httpx.get(url + "/metrics").text
            doc = httpx.get(url + "/debug/cost-model", headers={"Authorization": "Bearer adm"}).json()
            meta = doc["meta"]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        readyz[name] = (before, after)
        served[name] = doc
        print(f"\n{name}: {before} -> {after} after {meta['servedSteps']} served steps "
              f"({meta['servedFixedSeconds']} s + {meta['servedOverPredicted']} x)")
        assert meta["servedSteps"] >= SERVED_MIN_STEPS + SERVED_DERIVE_STEPS
    before, after = readyz["derived"]
    assert before["source"] == after["source"] == "derived"
    meta = served["derived"]["meta"]
    # One decode a step, each twice the table's 10 ms: the table's scale and about 10 ms more a step.
    assert meta["servedOverPredicted"] == 1.0 and 0.008 <= meta["servedFixedSeconds"] <= 0.02
    # What the served model derives: the document's line, bounded with its margin (a derived target
    # carries it). Steps of one size keep the line where it is, but the margin moves with the host (on a
    # busy one by more than the limits' tolerance between the derivation and the end), so with a margin
    # the document's history had in force on the way.
    got = SchedulerLimits(after["tokenBudget"], after["prefillChunkSize"], after["itlTargetMs"], after["source"])
    margins = sorted({meta["servedNoiseMargin"], *(m for _, m in meta["servedMarginHistory"])})
    candidates = [derive_scheduler_limits(resolve_config(None, []).scheduler, ServedBound(cost_model_from_document(
        {**served["derived"], "meta": {**meta, "servedNoiseMargin": m}}))) for m in margins]
    assert any(not limits_moved(expected, got) for expected in candidates), (margins, candidates, got)
    # The target at start is the table's with a cold start's margin; the line's adds the fixed cost.
    table_target = derive_scheduler_limits(resolve_config(None, []).scheduler, load_cost_model(str(cost))).itl_target_ms
    assert before["itlTargetMs"] == pytest.approx(table_target * (1 + SERVED_COLD_MARGIN), abs=0.1)
    assert after["itlTargetMs"] >= table_target + 0.8 * 1000 * meta["servedFixedSeconds"]
    assert f'magnitude_scheduler_itl_target_seconds{{source="derived"}} {after["itlTargetMs"] / 1000}' in metrics["derived"]
    # Every gap between the stream's decoding steps is judged against the target it was planned under
    # (the first decode follows the prefill step, which is not one). Each step is twice the table's,
    # the target carries the served line and its margin, so few if any run over it.
    gaps = {name: {result: float(re.search(rf'^magnitude_scheduler_itl_gaps_total{{result="{result}"}} (\S+)$',
                                           text, re.M).group(1)) for result in ("within", "over")}
            for name, text in metrics.items()}
    print(f"ITL gaps judged: {gaps}")
    judged = gaps["derived"]["within"] + gaps["derived"]["over"]
    assert SERVED_MIN_STEPS + SERVED_DERIVE_STEPS <= judged <= SERVED_MIN_STEPS + SERVED_DERIVE_STEPS + 8
    assert gaps["derived"]["within"] > gaps["derived"]["over"]
    before, after = readyz["set"]
    assert before == after == {"tokenBudget": 256, "prefillChunkSize": 128, "itlTargetMs": None, "source": "set"}
    assert gaps["set"] == {"within": 0.0, "over": 0.0}  # no target, nothing promised


def test_unknown_quantization_exits_2() -> None:
    r = subprocess.run(serve_cmd("--quantization", "int4"), env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--quantization" in r.stderr and "w8a16" in r.stderr


@pytest.mark.parametrize("key,value", [("minTop1Agreement", "1.5"), ("maxMeanKl", "-0.1"), ("minProbesPassed", "-1")])
def test_bad_quantization_thresholds_exit_2_naming_the_field(key: str, value: str) -> None:
    r = subprocess.run(serve_cmd("--runner", "simulated", "--set", f"quantizationEvaluation.{key}={value}"), env=env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"quantizationEvaluation.{key}" in r.stderr, r.stderr


def test_int8_on_cuda_exits_2_before_loading() -> None:
    r = subprocess.run(serve_cmd("--quantization", "int8", "--device", "cuda"), env=env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "CPU only" in r.stderr and "bfloat16" in r.stderr


DIE_AFTER_READY = """
import sys
from magnitude.server import simulated_runner

def execute(self, plan):
    raise RuntimeError("injected: device lost")

simulated_runner.SimulatedRunner.execute = execute
from magnitude.cli.main import main
sys.exit(main())
"""


def test_dead_engine_loop_exits_the_process_non_zero_saying_why() -> None:
    """A dead engine never serves again: the process exits (as vLLM's does) so that Kubernetes
    restarts the container; the requests it held get an error first."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", DIE_AFTER_READY, "serve", "--runner", "simulated", "--port", str(port), "--shutdown-grace", "5"],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 60)
        body = {"model": "simulated", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        statuses = []
        for _ in range(3):  # three whole-step failures in a row kill the loop
            try:
                statuses.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code)
            except httpx.TransportError:
                statuses.append(None)  # the process already went away
        assert statuses[0] == 500
        code = proc.wait(timeout=30)
        out = proc.stdout.read() if proc.stdout else ""
        assert code == 3, out
        assert "engine loop died" in out and "injected: device lost" in out and "exiting" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
