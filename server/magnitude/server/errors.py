"""Every error the HTTP server returns, in OpenAI's error shape, naming the offending parameter.

`APIError` is raised by handlers; the exception handlers installed by `install_error_handlers`
turn it, FastAPI's validation errors (400: OpenAI answers invalid parameters with 400), routing
errors (404/405) and anything unexpected (500) into `{"error": {"message", "type", "param", "code"}}`.
A 5xx whose cause is ours never carries exception text: the cause is logged with a request id and
the client gets a generic message naming that id; 4xx messages keep the detail that helps the client.
"""

from __future__ import annotations

import logging
import math
import re
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from magnitude.server.protocol import error_body, internal_error_message

log = logging.getLogger("magnitude.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error answer: HTTP status, OpenAI error fields and optional headers (Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


def _param_of(loc: tuple | list) -> str | None:
    """`('body', 'messages', 0, 'role')` -> `messages.0.role`; pydantic's union branch tags are dropped."""
    parts = [str(p) for p in loc if p != "body"]
    # Union branches show up as type names like 'str', 'list[str]', 'function-after[...]'.
    parts = [p for p in parts if not (p.startswith(("list[", "function-", "constrained-", "literal[", "dict["))
                                      or p in ("str", "int", "float", "bool") or p[:1].isupper())]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    # An unsupported field is named first: it is the error that explains the others away.
    first = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
    if first.get("type") == "extra_forbidden":
        param = _param_of(first.get("loc", ()))
        message = (f"unsupported parameter '{param}': Magnitude does not implement it, and refuses it rather than "
                   "ignore it (docs/server.md lists the supported fields)")
        return APIError(400, message, param=param, code="unsupported_parameter")
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", code="json_invalid")
    param = _param_of(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    # A check over a whole object names its field first ("tool_choice: requires tools"): the
    # parameter is that field of the object the check ran on.
    named = re.match(r"Value error, ([a-z_][a-z_0-9.]*): ", msg)
    if named and (param is None or not param.endswith(named.group(1))):
        param = f"{param}.{named.group(1)}" if param else named.group(1)
    if first.get("type") == "missing":
        message = f"missing required parameter '{param}'"
    else:
        message = f"invalid parameter '{param}': {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return APIError(400, message, param=param, code=str(first.get("type")))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return JSONResponse(
            error_body(message, _TYPES.get(exc.status_code, "invalid_request_error")),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        reference = f"err-{uuid.uuid4().hex}"
        log.exception("unhandled error on %s %s (request id %s)", request.method, request.url.path, reference)
        return JSONResponse(error_body(internal_error_message(reference), "server_error"), status_code=500)
