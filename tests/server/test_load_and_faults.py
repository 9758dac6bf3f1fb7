"""Behaviour under load and faults, on the simulated runner: disconnects, overload, shedding,
deadlines, failing requests and a dying engine."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import httpx
import pytest

from magnitude.engine.output import RunnerOutput, StepPlan
from magnitude.server.app import ServerSettings
from magnitude.server.simulated_runner import SimulatedRunner

from .conftest import RunningServer, serve, sim_config, simulated


def slow_cost(plan: Any) -> float:
    return 0.02


def wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def chat(content: str = "hi", max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": "simulated", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


def idle(s: RunningServer) -> bool:
    return (
        s.metric("magnitude_requests_running") == 0
        and s.metric("magnitude_requests_waiting") == 0
        and s.metric("magnitude_kv_cache_usage_ratio") == 0
    )


def test_disconnect_mid_stream_frees_everything() -> None:
    config = sim_config()
    with serve(simulated(config, slow_cost), config) as s:
        with httpx.stream("POST", s.v1 + "/chat/completions", json=chat(max_tokens=2000, stream=True), timeout=30) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(8)]
            assert any("content" in line for line in got)
            assert s.metric("magnitude_requests_running") == 1
            assert s.metric("magnitude_kv_cache_usage_ratio") > 0
        wait_for(lambda: idle(s))
        wait_for(lambda: s.metric("magnitude_requests_finished_total", status="cancelled") == 1)
        assert s.engine.num_tracked == 0


def test_disconnect_non_streaming_cancels() -> None:
    config = sim_config()
    with serve(simulated(config, slow_cost), config) as s:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.v1 + "/chat/completions", json=chat(max_tokens=2000), timeout=0.5)
        wait_for(lambda: s.metric("magnitude_requests_finished_total", status="cancelled") == 1)
        wait_for(lambda: idle(s))


def test_overload_answers_only_200_and_429_with_retry_after() -> None:
    config = sim_config(admission__max_queued_requests=6, scheduler__max_sequences=4)
    with serve(simulated(config, slow_cost), config) as s:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as c:
                return await asyncio.gather(
                    *(c.post(s.v1 + "/chat/completions", json=chat(f"req {i}", max_tokens=8, ignore_eos=True)) for i in range(60))
                )

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429}, codes
        ok = [r for r in responses if r.status_code == 200]
        rejected = [r for r in responses if r.status_code == 429]
        assert len(ok) >= 4 and rejected
        for r in rejected:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
        for r in ok:
            assert r.json()["usage"]["completion_tokens"] == 8
        assert s.metric("magnitude_rejections_total") == len(rejected)
        assert s.metric("magnitude_requests_finished_total", status="finished") == len(ok)
        wait_for(lambda: idle(s))


def test_admin_shedding_rejects_the_least_important_class() -> None:
    config = sim_config()
    with serve(simulated(config), config, ServerSettings(admin_token="adm")) as s:
        assert httpx.post(s.url + "/admin/shedding", json={"enabled": True}).status_code == 401
        r = httpx.post(s.url + "/admin/shedding", json={"enabled": True}, headers={"Authorization": "Bearer adm"})
        assert r.status_code == 200 and r.json()["shed_classes"] == ["batch"]
        assert s.metric("magnitude_admission_shedding") == 1
        r = httpx.post(s.v1 + "/chat/completions", json=chat(priority_class="batch"))
        assert r.status_code == 429 and r.json()["error"]["code"] == "shedding" and "Retry-After" in r.headers
        assert httpx.post(s.v1 + "/chat/completions", json=chat(priority_class="interactive")).status_code == 200
        r = httpx.post(s.url + "/admin/shedding", json={"classes": ["batch", "standard"]}, headers={"Authorization": "Bearer adm"})
        assert r.json()["shed_classes"] == ["batch", "standard"]
        assert s.metric("magnitude_admission_shed_class", priority_class="standard") == 1
        r = httpx.post(s.url + "/admin/shedding", json={"classes": ["gold"]}, headers={"Authorization": "Bearer adm"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "classes"
        httpx.post(s.url + "/admin/shedding", json={"enabled": False}, headers={"Authorization": "Bearer adm"})
        assert s.metric("magnitude_admission_shedding") == 0
        assert s.metric("magnitude_admission_shed_class", priority_class="batch") == 0
        assert httpx.post(s.v1 + "/chat/completions", json=chat(priority_class="batch")).status_code == 200


def test_admin_disabled_without_token(sim_server: RunningServer) -> None:
    r = httpx.post(sim_server.url + "/admin/shedding", json={"enabled": True})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"


def test_deadline_ends_request_with_clear_error() -> None:
    config = sim_config()
    with serve(simulated(config, slow_cost), config) as s:
        r = httpx.post(s.v1 + "/chat/completions", json=chat(max_tokens=500, deadline_ms=200), timeout=30)
        assert r.status_code in (429, 504), r.text
        assert "deadline" in r.json()["error"]["message"] or "deadline" in r.json()["error"]["code"]
        wait_for(lambda: idle(s))


class FailingRunner(SimulatedRunner):
    """Fault injection at the runner boundary: fails requests whose prompt contains the bytes FAIL."""

    MARK = list(b"FAIL")
    crash_steps = False

    def execute(self, plan: StepPlan) -> RunnerOutput:
        if self.crash_steps:
            raise RuntimeError("device lost")
        out = super().execute(plan)
        for seq in plan.seqs:
            ids = seq.token_ids
            if any(ids[i : i + 4] == self.MARK for i in range(len(ids) - 3)):
                out.failed[seq.request_id] = "injected fault"
                out.sampled.pop(seq.request_id, None)
        return out


def test_one_failing_request_fails_alone(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="magnitude")
    config = sim_config()
    with serve(simulated(config, runner_cls=FailingRunner), config) as s:

        async def both() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as c:
                return await asyncio.gather(
                    c.post(s.v1 + "/chat/completions", json=chat("please FAIL", max_tokens=20)),
                    c.post(s.v1 + "/chat/completions", json=chat("fine", max_tokens=20)),
                )

        bad, good = asyncio.run(both())
        # The cause is ours: the client gets a generic message naming the request id; the log has the cause.
        error = bad.json()["error"]
        assert bad.status_code == 500 and error["type"] == "server_error" and "injected fault" not in error["message"]
        request_id = error["message"].rsplit("request id ", 1)[1].split()[0].rstrip(".;)")
        assert request_id.startswith("cmpl-")
        assert any(request_id in r.getMessage() and "injected fault" in r.getMessage() for r in caplog.records)
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 20
        assert httpx.get(s.url + "/readyz").status_code == 200
        wait_for(lambda: idle(s))


def test_engine_loop_failure_fails_readiness() -> None:
    config = sim_config()
    with serve(simulated(config, runner_cls=FailingRunner), config) as s:
        FailingRunner.crash_steps = True
        try:
            # A step that raises fails its requests; a runner that keeps raising kills the loop.
            for _ in range(3):
                r = httpx.post(s.v1 + "/chat/completions", json=chat(max_tokens=50), timeout=30)
                assert r.status_code in (500, 503), r.text
                assert "device lost" not in r.text  # the exception's text stays in the log
            wait_for(lambda: httpx.get(s.url + "/readyz").status_code == 503)
            body = httpx.get(s.url + "/readyz").json()
            assert body["phase"] == "dead" and "device lost" not in body["message"]
            r = httpx.post(s.v1 + "/chat/completions", json=chat())
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready:dead" and "device lost" not in r.text
            # Liveness fails too, so the kubelet restarts the container (`magnitude serve` also exits).
            r = httpx.get(s.url + "/healthz")
            assert r.status_code == 503 and r.json()["status"] == "dead" and "device lost" not in r.text
            r = httpx.get(s.url + "/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead" and "device lost" not in r.text
        finally:
            FailingRunner.crash_steps = False


def test_not_ready_while_loading_then_progress_stream() -> None:
    config = sim_config()
    gate = threading.Event()

    def slow_load(progress: Any) -> SimulatedRunner:
        progress("loading_weights", 0.5)
        gate.wait(10)
        return SimulatedRunner(config, lambda plan: 0.001)

    with serve(slow_load, config, wait_ready=False) as s:
        r = httpx.get(s.url + "/readyz")
        assert r.status_code == 503 and r.json()["phase"] == "loading_weights"
        # Loading is alive: liveness must not restart a pod that is still loading its model.
        assert httpx.get(s.url + "/healthz").status_code == 200
        r = httpx.get(s.url + "/health")
        assert r.status_code == 200 and r.content == b""
        r = httpx.post(s.v1 + "/chat/completions", json=chat())
        assert r.status_code == 503 and "Retry-After" in r.headers
        events: list[str] = []
        with httpx.stream(
            "POST", s.v1 + "/chat/completions", json=chat(stream=True, stream_options={"include_progress": True}), timeout=30
        ) as resp:
            for line in resp.iter_lines():
                events.append(line)
                if '"loading"' in line:
                    gate.set()
        assert any('"phase":"loading"' in e for e in events)
        assert any('"phase":"queued"' in e for e in events)
        assert [e for e in events if e][-1] == "data: [DONE]"
        assert httpx.get(s.url + "/readyz").status_code == 200


def test_unexpected_exception_answers_a_generic_500_and_logs_the_cause(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="magnitude")
    config = sim_config()
    with serve(simulated(config), config) as s:

        def broken_submit(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("secret detail /internal/path")

        s.engine.submit = broken_submit  # type: ignore[method-assign]
        r = httpx.post(s.v1 + "/chat/completions", json=chat())
        error = r.json()["error"]
        assert r.status_code == 500 and error["type"] == "server_error"
        assert "secret" not in r.text and "RuntimeError" not in r.text
        ref = error["message"].rsplit("request id ", 1)[1].split()[0].rstrip(".;)")
        assert any(ref in rec.getMessage() for rec in caplog.records if rec.exc_info and "secret detail" in str(rec.exc_info[1]))
        # 4xx messages that help the client keep their detail.
        r = httpx.post(s.v1 + "/chat/completions", json=chat(temperature=3.0))
        assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


class StuckRunner(SimulatedRunner):
    """A runner whose step hangs (a wedged device, a deadlock) until released."""

    release = threading.Event()
    hang = False

    def execute(self, plan: StepPlan) -> RunnerOutput:
        if self.hang:
            self.release.wait(30)
        return super().execute(plan)


def test_a_step_stuck_past_the_stall_timeout_fails_liveness_until_it_returns() -> None:
    """A hung engine serves nobody and, unlike a dead one, never says so: liveness fails while one
    step has run longer than `stall_timeout_s`, so the kubelet restarts the pod."""
    config = sim_config()
    with serve(simulated(config, runner_cls=StuckRunner), config) as s:
        s.engine.stall_timeout_s = 0.3
        StuckRunner.release.clear()
        StuckRunner.hang = True
        try:
            with httpx.Client(timeout=30) as c:
                pending = threading.Thread(target=lambda: c.post(s.v1 + "/chat/completions", json=chat()))
                pending.start()
                wait_for(lambda: httpx.get(s.url + "/healthz").status_code == 503)
                body = httpx.get(s.url + "/healthz").json()
                assert body["status"] == "stalled" and "0.3" in body["message"]
                assert httpx.get(s.url + "/health").status_code == 503
                StuckRunner.hang = False
                StuckRunner.release.set()
                pending.join(30)
            wait_for(lambda: httpx.get(s.url + "/healthz").status_code == 200)
            assert httpx.post(s.v1 + "/chat/completions", json=chat()).status_code == 200
        finally:
            StuckRunner.hang = False
            StuckRunner.release.set()
