"""Tells engine pods which priority classes to shed: `POST /admin/shedding` with the shared token.

Body `{"enabled": bool, "classes": [...]}` (docs/operator.md). The exchange has one deadline and a
byte cap (`podhttp`): a pod that never answers costs this service's tick one deadline, no more.
"""

from __future__ import annotations

import logging

import httpx

from magnitude.operator.podhttp import PodHttpError, request

log = logging.getLogger(__name__)
DEADLINE_SECONDS = 3.0
MAX_ANSWER_BYTES = 64 << 10  # the answer is a small JSON document; it is not even read


async def set_shedding(client: httpx.AsyncClient, base_url: str, token: str, classes: tuple[str, ...]) -> bool:
    """True when the engine accepted the new shedding state."""
    headers = {"Authorization": f"Bearer {token}"}
    body: dict[str, object] = {"enabled": bool(classes), "classes": list(classes)}
    try:
        status, _ = await request(client, "POST", f"{base_url}/admin/shedding", deadline=DEADLINE_SECONDS,
                                  max_bytes=MAX_ANSWER_BYTES, json=body, headers=headers)
    except PodHttpError as e:
        log.info("POST %s/admin/shedding: %s", base_url, e)
        return False
    return status == 200
