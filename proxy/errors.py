"""The one builder of OpenAI-shaped error bodies and responses."""

from __future__ import annotations

import json
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


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   type_: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style JSON error. 5xx default to `server_error`/`upstream_error` types."""
    if type_ is None:
        fallback = "upstream_error" if status in (502, 504) else "server_error"
        type_ = _TYPE_BY_STATUS.get(status, fallback)
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
        return error_response(self.status, self.message, param=self.param, code=self.code,
                              type_=self.type_, headers=self.headers)

    def sse_event(self) -> bytes:
        """The same error as one SSE `data:` event, for streams that already started."""
        body = error_body(self.message, self.type_ or "upstream_error", param=self.param,
                          code=self.code)
        return b"data: " + json.dumps(body).encode() + b"\n\n"
