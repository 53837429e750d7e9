"""The one builder of OpenAI-shaped error bodies and responses, and the middleware that
turns every failure of a handler into one (used by the proxy and the worker)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web


def error_body(message: str, type_: str = "invalid_request_error", *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
    429: "rate_limit_error", 499: "client_closed_request",
}


def status_type(status: int) -> str:
    fallback = "upstream_error" if status in (502, 504) else "server_error"
    return _TYPE_BY_STATUS.get(status, fallback)


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   type_: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style JSON error. 5xx default to `server_error`/`upstream_error` types."""
    type_ = type_ or status_type(status)
    return web.Response(status=status, headers=headers, content_type="application/json",
                        text=json.dumps(error_body(message, type_, param=param, code=code)))


class ApiError(Exception):
    """Raised anywhere in request handling; the middleware turns it into `error_response`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type_, self.headers = type_, headers

    def response(self) -> web.Response:
        """The error as a response; a 408 (a body too slow) also closes the connection."""
        resp = error_response(self.status, self.message, param=self.param, code=self.code,
                              type_=self.type_, headers=self.headers)
        if self.status == 408:
            resp.force_close()
        return resp

    def sse_event(self) -> bytes:
        """The same error as one SSE `data:` event, for streams that already started."""
        body = error_body(self.message, self.type_ or status_type(self.status),
                          param=self.param, code=self.code)
        return b"data: " + json.dumps(body).encode() + b"\n\n"


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
               400: "bad_request"}
log = logging.getLogger("prefixd.errors")


@web.middleware
async def errors_middleware(request: web.Request,
                            handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                            ) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, "request body is too large", code="request_too_large")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        msg = e.reason if e.status != 404 else f"no route for {request.method} {request.path}"
        if e.status == 405:
            msg = f"method {request.method} not allowed on {request.path}"
        return error_response(e.status, msg, code=_HTTP_CODES.get(e.status))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal error in prefixd (see its log)",
                              code="internal_error")


