"""Fixtures for the operator tests; the helpers themselves live in `opkit`."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from opkit import FakeApiServer, load_crd, validate


@pytest.fixture
def crd_validate() -> Callable[[dict[str, Any]], tuple[dict[str, Any], list[str]]]:
    crd = load_crd()
    return lambda obj: validate(obj, crd)


@pytest.fixture
def api() -> FakeApiServer:
    return FakeApiServer()
