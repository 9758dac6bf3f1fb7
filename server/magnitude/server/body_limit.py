"""Refuse request bodies over a size limit with 413 before they are buffered in memory.

Pure ASGI middleware: a declared Content-Length over the limit is answered at once; a chunked
body is counted as it arrives and refused as soon as it passes the limit.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from magnitude.server.protocol import error_body

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


class BodySizeLimit:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, send: Send) -> None:
        body = json.dumps(error_body(f"request body larger than {self.max_bytes} bytes", "invalid_request_error")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._reject(send)
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
            if seen > self.max_bytes:
                await self._reject(send)
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
