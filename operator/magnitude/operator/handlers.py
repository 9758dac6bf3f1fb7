"""Kopf handlers: thin, level-based, each one call into `reconcile` or the loop.

Settings chosen for least privilege and safe deletion: no cluster scanning (no CRD or namespace
watch), standalone (no peering objects: run one replica), progress and diff-base kept in our own
annotations, and no timers or delete handlers, so Kopf adds no finalizer and deleting a
ModelService never waits for the operator. Errors say whether to retry.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from magnitude.operator import loop
from magnitude.operator.apply import API_CONNECT_SECONDS, API_DEADLINE_SECONDS, ApiError, Kube
from magnitude.operator.reconcile import SpecInvalid, reconcile
from magnitude.operator.spec import GROUP, PLURAL, VERSION

ANNOTATION_PREFIX = GROUP
RETRY_DELAY_SECONDS = 5.0
WATCH_SERVER_TIMEOUT_SECONDS = 300
REGISTRY = loop.Registry()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.scanning.disabled = True
    settings.peering.standalone = True
    settings.posting.level = logging.WARNING
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    # Kopf's own calls get deadlines too: a silent API server must not hang its patches or a
    # watch that the server should have ended (server_timeout) for ever.
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_SECONDS
    settings.watching.client_timeout = WATCH_SERVER_TIMEOUT_SECONDS + 30
    settings.watching.connect_timeout = API_CONNECT_SECONDS
    settings.networking.request_timeout = API_DEADLINE_SECONDS
    settings.networking.connect_timeout = API_CONNECT_SECONDS
    memo.kube = Kube.from_environment()
    memo.stop = asyncio.Event()
    memo.loop_task = asyncio.create_task(loop.run(memo.kube, REGISTRY, memo.stop))


@kopf.on.cleanup()
async def stop_loop(memo: kopf.Memo, **_: Any) -> None:
    memo.stop.set()
    memo.loop_task.cancel()
    await asyncio.gather(memo.loop_task, return_exceptions=True)


@kopf.on.event(GROUP, VERSION, PLURAL)
def track(type: str | None, body: kopf.Body, **_: Any) -> None:
    meta = body["metadata"]
    if type == "DELETED":
        REGISTRY.forget(meta["namespace"], meta["name"])
    else:
        REGISTRY.entry(meta["namespace"], meta["name"], dict(body))


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile_spec(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    meta = body["metadata"]
    entry = REGISTRY.entry(meta["namespace"], meta["name"], dict(body))
    try:
        with entry.lock:
            reconcile(memo.kube, dict(body))
    except SpecInvalid as e:
        raise kopf.PermanentError(str(e)) from e
    except ApiError as e:
        if e.temporary:
            raise kopf.TemporaryError(str(e), delay=RETRY_DELAY_SECONDS) from e
        raise kopf.PermanentError(str(e)) from e
