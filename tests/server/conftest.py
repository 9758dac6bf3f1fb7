"""Fixtures: a real uvicorn server on a free loopback port, in a thread, around a real AsyncEngine.

Simulated-runner servers are cheap and made per test (or per module); the real-model server is
one per session (loading takes a while on two cores).
"""

from __future__ import annotations

import json

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
import uvicorn

from magnitude.policy.schema import EngineConfig
from magnitude.server.app import ServerSettings, create_app
from magnitude.server.async_engine import AsyncEngine
from magnitude.server.metrics import EngineMetrics
from magnitude.server.simulated_runner import SimulatedRunner


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fast_cost(plan: Any) -> float:
    """A quick linear step-time model (seconds) so simulated tests run in well under a second each."""
    return 0.002 + 2e-6 * (plan.num_tokens - plan.num_decode) + 1e-4 * plan.num_decode


class RunningServer:
    def __init__(self, url: str, engine: AsyncEngine, metrics: EngineMetrics, server: uvicorn.Server) -> None:
        self.url = url
        self.engine = engine
        self.metrics = metrics
        self.server = server

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a series' samples on /metrics matching `labels` (read over HTTP, as Prometheus would)."""
        total = 0.0
        found = False
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            series, value = line.rsplit(" ", 1)
            base, _, rest = series.partition("{")
            if base != name:
                continue
            if all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += float(value)
                found = True
        if not found and not labels:
            raise KeyError(name)
        return total


@contextmanager
def serve(
    load_runner: Callable[[Any], Any],
    config: EngineConfig,
    settings: ServerSettings | None = None,
    ready_timeout: float = 900.0,
    wait_ready: bool = True,
    metrics: EngineMetrics | None = None,
) -> Iterator[RunningServer]:
    metrics = metrics if metrics is not None else EngineMetrics(tenant_labels=config.tenant_labels)
    engine = AsyncEngine(config, load_runner, metrics)
    app = create_app(engine, metrics.registry, settings or ServerSettings())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    try:
        while time.monotonic() < deadline:
            try:
                r = httpx.get(url + "/readyz", timeout=2)
                if r.status_code == 200 or (not wait_ready and server.started):
                    break
                if r.json().get("phase") == "failed":
                    raise RuntimeError(f"engine failed to load: {r.json()}")
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        else:
            raise TimeoutError(f"server on {url} not ready in {ready_timeout}s")
        yield RunningServer(url, engine, metrics, server)
    finally:
        server.should_exit = True
        thread.join(15)


def sim_config(**overrides: Any) -> EngineConfig:
    doc: dict[str, Any] = {"kvCache": {"numBlocks": 256, "blockSize": 16}}
    for key, value in overrides.items():
        section, field = key.split("__")
        doc.setdefault(section, {})[field] = value
    return EngineConfig.model_validate(doc)


def simulated(config: EngineConfig, cost: Callable[[Any], float] = fast_cost, runner_cls: type = SimulatedRunner) -> Callable[[Any], Any]:
    return lambda progress: runner_cls(config, cost)


@pytest.fixture
def sim_server() -> Iterator[RunningServer]:
    config = sim_config()
    with serve(simulated(config), config) as s:
        yield s


@pytest.fixture(scope="session")
def model_server() -> Iterator[RunningServer]:
    """The real bundled model behind a real server: one per test session."""
    pytest.importorskip("torch")
    from magnitude.runner import ModelRunner

    config = EngineConfig.model_validate({"kvCache": {"numBlocks": 512}})
    load = lambda progress: ModelRunner(num_blocks=512, progress=progress)  # noqa: E731
    with serve(load, config) as s:
        yield s


@pytest.fixture(scope="module")
def cost_model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A step-cost table in `magnitude profile`'s format, for real-model servers whose tests are about
    something else (weights, records): `--cost-model` skips the start-up calibration, which
    tests/runner/test_calibration.py covers, and which costs each such server half a minute."""
    path = tmp_path_factory.mktemp("cost-model") / "cost.json"
    path.write_text(json.dumps({"kind": "table", "decode_batch_sizes": [0, 1, 16], "prefill_tokens": [0, 16, 256],
                                "seconds": [[1e-6, 0.1, 0.7], [0.05, 0.12, 0.75], [0.2, 0.3, 0.9]]}))
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root of its own per test module (quantization records, cost models), sharing the
    converted model with the user's cache so no module converts it again."""
    from magnitude.runner.loading import cache_root

    root = tmp_path_factory.mktemp("magnitude-cache")
    (cache_root() / "models").mkdir(parents=True, exist_ok=True)
    (root / "models").symlink_to(cache_root() / "models")
    return root
