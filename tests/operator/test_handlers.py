"""Kopf wiring: thin handlers, retry semantics, and nothing that would add a finalizer."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import kopf
import pytest

from magnitude.operator import handlers
from magnitude.operator.apply import ApiError
from opkit import FakeApiServer
from opkit import body


def registry() -> Any:
    return kopf.get_default_registry()


def test_no_timers_daemons_or_delete_handlers_so_no_finalizer() -> None:
    r = registry()
    assert list(r._spawning.get_all_handlers()) == []  # timers and daemons would add a finalizer
    changing = list(r._changing.get_all_handlers())
    assert changing and not any(h.requires_finalizer for h in changing)
    assert {h.reason for h in changing} == {kopf.Reason.CREATE, kopf.Reason.UPDATE, None}  # None: resume
    assert [h.id for h in r._watching.get_all_handlers()] == ["track"]


def test_handler_reconciles_and_feeds_the_loop_registry() -> None:
    api = FakeApiServer()
    b = body(api)
    handlers.reconcile_spec(body=b, memo=SimpleNamespace(kube=api))
    assert api.find("Deployment", "chat") is not None
    assert handlers.REGISTRY.entry("ml", "chat").body["metadata"]["uid"] == "ms-uid"
    handlers.track(type="DELETED", body=b)
    assert ("ml", "chat") not in dict(handlers.REGISTRY.items())


@pytest.mark.parametrize("error, kind", [
    (ApiError("conflict", 409), kopf.TemporaryError),
    (ApiError("apiserver down", None), kopf.TemporaryError),
    (ApiError("forbidden", 403), kopf.PermanentError),
])
def test_api_errors_say_whether_to_retry(monkeypatch: pytest.MonkeyPatch, error: ApiError, kind: type) -> None:
    def fail(*_: Any, **__: Any) -> None:
        raise error
    monkeypatch.setattr(handlers, "reconcile", fail)
    with pytest.raises(kind):
        handlers.reconcile_spec(body=body(FakeApiServer()), memo=SimpleNamespace(kube=None))


def test_unparseable_spec_is_a_permanent_error() -> None:
    api = FakeApiServer()
    with pytest.raises(kopf.PermanentError, match="maxReplicas"):
        handlers.reconcile_spec(body=body(api, maxReplicas="many"), memo=SimpleNamespace(kube=api))
