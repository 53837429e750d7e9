"""The one object a request carries through the pipeline: what the client sent, what each
stage decided, the response state, and the trace that becomes its metrics and log line.

Error delivery depends on the response state, and only here: before anything was sent, a
JSON error in the client API's shape; once an SSE stream started, an error event in that
API's stream shape, then the end of the stream; once a JSON body started, the connection is
aborted (half a JSON document cannot be repaired, and a client must not take it as whole).
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from prefixd.api.errors import ApiError, error_body, status_type
from prefixd.api.schema import Kind, Parsed
from prefixd.proxy.attempt import Attempt
from prefixd.proxy.prefix.report import header
from prefixd.proxy.prefix.tracker import Prepared
from prefixd.proxy.trace import RequestTrace

if TYPE_CHECKING:
    from prefixd.proxy.translate.base import StreamTranslator, Translator

log = logging.getLogger("prefixd.request")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


class ResponseState(enum.Enum):
    NOT_STARTED = "not_started"
    SSE = "sse_started"
    JSON = "json_started"


@dataclass(frozen=True)
class ClientApi:
    """A client-facing API: its route, the internal request form it becomes, and (for APIs
    other than OpenAI's own) the translator to and from that form."""

    name: str                     # "chat", "completions", "anthropic", "responses"
    path: str
    kind: Kind                    # the internal request: "chat" or "completion"
    translator: Translator | None = None     # None for OpenAI's own APIs

    def error_body(self, e: ApiError) -> dict[str, Any]:
        type_ = e.type_ or status_type(e.status)
        if self.translator is not None:
            return self.translator.error_body(e.status, type_, e.message, e.param, e.code)
        return error_body(e.message, type_, param=e.param, code=e.code)

    def sse_error(self, e: ApiError, stream: StreamTranslator | None = None) -> bytes:
        body = self.error_body(e)
        if stream is not None:
            return stream.error(body)
        return b"data: " + json.dumps(body).encode() + b"\n\n" + b"data: [DONE]\n\n"


@dataclass(eq=False)       # identity-hashed: the proxy keeps a set of those in flight
class Exchange:
    request: web.Request
    api: ClientApi
    trace: RequestTrace
    raw: bytes = b""
    client_body: dict[str, Any] = field(default_factory=dict)   # as the client sent it
    parsed: Parsed | None = None        # the internal chat/completions request
    model: str | None = None            # the served model it resolved to
    prepared: Prepared | None = None    # lane, canonicalized body, prefix report
    namespace: str = ""                 # its cache partition (PREFIXD_CACHE_ISOLATION=per_key)
    prompt_ids: list[int] | None = None  # its token ids, when routing follows KV events
    attempt: Attempt | None = None      # the current (last) try on a backend, and its answer
    response: web.StreamResponse | None = None
    state: ResponseState = ResponseState.NOT_STARTED
    failed: bool = False                # an error was delivered: nothing more is sent

    @property
    def stream(self) -> bool:
        return bool(self.parsed and self.parsed.req.stream)

    @property
    def answered(self) -> bool:
        """A 200 answer went out whole (from the last attempt)."""
        return self.attempt is not None and self.attempt.completed

    def headers(self) -> dict[str, str]:
        """Prefixd's own response headers; the prefix report as it stands now (routing and
        a transfer add their predictions to it before the answer starts)."""
        out = {"X-Request-Id": self.trace.request_id}
        if self.attempt is not None:
            out["X-Prefixd-Backend"] = self.attempt.backend.name
            if self.attempt.clamp is not None:
                out["X-Prefixd-Max-Tokens"] = self.attempt.clamp.header()
        if self.prepared is not None and self.prepared.report is not None:
            out["X-Prefixd-Prefix"] = header(self.prepared.report, self.prepared.served)
        return out

    async def start(self, status: int, headers: dict[str, str], sse: bool) -> web.StreamResponse:
        """Send the status line and headers; from now on errors go by `state`."""
        assert self.response is None
        resp = web.StreamResponse(status=status, headers={**headers, **self.headers()})
        self.response = resp
        self.state = ResponseState.SSE if sse else ResponseState.JSON
        await resp.prepare(self.request)
        return resp

    async def fail(self, e: ApiError) -> web.StreamResponse:
        """Deliver `e` the only way the response state allows (once)."""
        if self.failed and self.response is not None:
            return self.response
        self.failed = True
        self.trace.status, self.trace.error = e.status, e.message
        if self.state is ResponseState.NOT_STARTED:
            resp = web.json_response(self.api.error_body(e), status=e.status,
                                     headers={**(e.headers or {}), **self.headers()})
            if e.status == 408:              # a body too slow: the connection goes too
                resp.force_close()
            return resp
        assert self.response is not None
        try:
            if self.state is ResponseState.SSE:
                stream = self.attempt.stream_out if self.attempt is not None else None
                await self.response.write(self.api.sse_error(e, stream))
                await self.response.write_eof()
            else:
                log.warning("request %s: %s after the JSON body started; aborting the "
                            "connection", self.trace.request_id, e.message)
                if self.request.transport is not None:
                    self.request.transport.abort()
        except (ConnectionResetError, OSError):
            pass
        return self.response
