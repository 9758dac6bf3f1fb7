"""HTTP to engine pods with a deadline and a byte cap for the whole exchange.

The operator reads `/metrics` and posts `/admin/shedding` to pods it does not trust to behave: a
pod may answer slowly, trickle one byte at a time (which a per-read timeout never catches) or
send an endless body. `request()` bounds the exchange as a whole (connect, headers and body
together) with `asyncio.timeout`, and stops reading once the body passes `max_bytes`. Every
failure is a `PodHttpError` whose message says why, for the conditions and Events that name the
pod.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx


class PodHttpError(Exception):
    """A request to a pod that gave no usable answer; the message says why (for people)."""


async def request(client: httpx.AsyncClient, method: str, url: str, *, deadline: float, max_bytes: int,
                  **kwargs: Any) -> tuple[int, bytes]:
    """(status, body) of one request finished within `deadline` seconds with at most `max_bytes`."""
    try:
        async with asyncio.timeout(deadline):
            async with client.stream(method, url, timeout=deadline, **kwargs) as resp:
                declared = resp.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes:
                    raise PodHttpError(f"answer of {int(declared)} bytes is over the {max_bytes}-byte cap")
                body = bytearray()
                async for chunk in resp.aiter_bytes():  # decoded: a compressed bomb is capped too
                    body += chunk
                    if len(body) > max_bytes:
                        raise PodHttpError(f"answer is over the {max_bytes}-byte cap")
                return resp.status_code, bytes(body)
    except TimeoutError as e:  # asyncio's deadline (httpx's own timeouts are HTTPErrors)
        raise PodHttpError(f"no complete answer within {deadline:g}s") from e
    except httpx.TimeoutException as e:
        raise PodHttpError(f"no complete answer within {deadline:g}s ({type(e).__name__})") from e
    except httpx.HTTPError as e:
        raise PodHttpError(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from e
