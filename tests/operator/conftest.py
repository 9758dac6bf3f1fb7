"""Fixtures for the operator tests; the helpers themselves live in `opkit`.

`apiserver` is one real etcd + kube-apiserver for the session (skipped, naming
`make e2e-build`, when the binaries are not built; a failure under CI=true); `api` gives each
test its own namespace on it."""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Iterator

import pytest

from opkit import ROOT, SERVICE_MONITOR_CRD, ApiServer, Env, load_crd, validate


@pytest.fixture
def crd_validate() -> Callable[[dict[str, Any]], tuple[dict[str, Any], list[str]]]:
    crd = load_crd()
    return lambda obj: validate(obj, crd)


@pytest.fixture(scope="session")
def apiserver() -> Iterator[ApiServer]:
    state = ROOT / "e2e" / ".state" / f"operator-api-{os.getpid()}"
    server = ApiServer.start(state)
    yield server
    leaked = server.stop()
    if leaked:
        pytest.fail(f"processes left running after teardown: {leaked}", pytrace=False)
    if not os.environ.get("E2E_KEEP_STATE"):
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def api(apiserver: ApiServer) -> Env:
    return Env(apiserver)


@pytest.fixture
def service_monitors(apiserver: ApiServer) -> Iterator[None]:
    """The ServiceMonitor kind served for the length of one test (removed after: the other tests
    expect a cluster without it)."""
    apiserver.install_crd(SERVICE_MONITOR_CRD)
    yield
    apiserver.delete_crd(SERVICE_MONITOR_CRD["metadata"]["name"])
