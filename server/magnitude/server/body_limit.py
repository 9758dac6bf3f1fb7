"""Refuse request bodies over a size limit with 413 before they are buffered in memory.

Pure ASGI middleware: a declared Content-Length over the limit is answered at once; a chunked
body is counted as it arrives and refused as soon as it passes the limit. The limit may be a
function, read per request: the server's default is what the loaded model's context can use
(`context_body_bytes`), and DEFAULT_MAX_BODY_BYTES before the model is loaded.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from magnitude.server.protocol import error_body

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
BODY_OVERHEAD_BYTES = 1024 * 1024  # field names, message framing, stop strings, options


def context_body_bytes(max_prompt_chars: int, max_model_len: int) -> int:
    """The largest body a request that fits the context can need: every prompt character written
    as an escaped surrogate pair (12 bytes, as `json.dumps` writes an emoji), or every token id
    written out (at most 11 bytes with its comma), plus the rest of the request."""
    return max(12 * max_prompt_chars, 11 * max_model_len) + BODY_OVERHEAD_BYTES


class BodySizeLimit:
    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        max_bytes: int | Callable[[], int] = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.app = app
        self._max_bytes = max_bytes

    @property
    def max_bytes(self) -> int:
        return self._max_bytes() if callable(self._max_bytes) else self._max_bytes

    async def _reject(self, send: Send, limit: int) -> None:
        body = json.dumps(error_body(f"request body larger than {limit} bytes", "invalid_request_error")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await self._reject(send, limit)
                return
        if any(name == b"content-length" for name, _ in scope.get("headers", [])):
            await self.app(scope, receive, send)  # the server enforces the declared length
            return
        # Chunked: buffer up to the limit (FastAPI buffers the body anyway), then replay it.
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # client went away mid-body
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > limit:
                await self._reject(send, limit)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
