"""Tells engine pods which priority classes to shed: `POST /admin/shedding` with the shared token.

Body `{"enabled": bool, "classes": [...]}` (docs/operator.md).
"""

from __future__ import annotations

import httpx

TIMEOUT_SECONDS = 3.0


async def set_shedding(client: httpx.AsyncClient, base_url: str, token: str, classes: tuple[str, ...]) -> bool:
    """True when the engine accepted the new shedding state."""
    headers = {"Authorization": f"Bearer {token}"}
    body: dict[str, object] = {"enabled": bool(classes), "classes": list(classes)}
    try:
        resp = await client.post(f"{base_url}/admin/shedding", json=body, headers=headers, timeout=TIMEOUT_SECONDS)
        return resp.status_code == 200
    except httpx.HTTPError:
        return False
