"""Malformed HTTP (a request line, header or body framing that aiohttp refuses before any
handler runs), answered the same way by the proxy (`proxy/guard.py`) and the worker
(`backends/mlx/server/protocol.py`): a JSON error in the OpenAI shape, the connection closed, and at
most one bounded log line per kind every few seconds — never a traceback for a client's bytes
(a managed worker's stderr is the proxy's log; an attacker must not fill it). Both sockets'
connection protocols are `TimedHandler`s: a deadline for every request's headers, and a body
that missed its deadline closes its connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from prefixd.api.errors import error_response

REASON_CHARS = 200          # of aiohttp's reason, which may quote the bytes it refused


class RateLimitedLog:
    """One warning per `key` at most every `every_s` seconds, counting what was left out."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.log, self.every_s = logger, every_s
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        last, skipped = self._last.get(key, (-self.every_s, 0))
        if now - last < self.every_s:
            self._last[key] = (last, skipped + 1)
            return
        self._last[key] = (now, 0)
        suffix = f" ({skipped} more since the last such line)" if skipped else ""
        self.log.warning(msg + suffix, *args)


def protocol_error(request: Any, status: int, exc: BaseException | None, message: str | None,
                   limited: RateLimitedLog, who: str) -> web.Response:
    """The answer to a request aiohttp could not handle (`RequestHandler.handle_error`): a
    client's malformed bytes (4xx, one line), or our own failure (5xx, with its traceback)."""
    if request.writer.output_size > 0:
        raise ConnectionError("response already started; cannot send an error")
    if status >= 500:
        limited.log.error("%s: error handling a request from %s", who, request.remote,
                          exc_info=exc)
        text, code = f"internal error in {who} (see its log)", "internal_error"
    else:
        # aiohttp's reason spans lines (it points at the byte): one line, bounded
        reason = " ".join(str(message or exc or "bad request").split())[:REASON_CHARS]
        limited.warning(f"protocol:{status}", "%s: malformed HTTP from %s: %s", who,
                        request.remote, reason)
        text, code = f"malformed HTTP request: {reason}", "bad_request"
    resp = error_response(status, text, code=code)
    resp.force_close()
    return resp


CUT_LINGER_S = 1.0      # a cut connection's lingering read, at most


class TimedHandler(RequestHandler):
    """aiohttp's connection protocol with deadlines: every request's headers are due within
    `header_timeout_s` (the first's from the connection's opening, a later one's from its
    first byte: a keep-alive connection cannot trickle its next request's headers either),
    else the connection is closed; and a handler can `cut` the connection after its answer,
    with aiohttp's lingering read of an unread body (10 s of a trickling client's bytes) cut to
    `CUT_LINGER_S`, as a body that missed its deadline does (`api/reading.py`).
    `time_requests` tells it when a request's headers are complete."""

    header_timeout_s = 0.0                  # 0: no header deadline; set by its server
    limited: RateLimitedLog | None = None   # the log of closed connections
    _between = True                         # no request's headers under way complete yet
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._between and self._deadline is None:
            self._arm()                     # the first bytes of a next request
        super().data_received(data)

    def request_started(self) -> None:
        self._between = False
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    async def finish_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().finish_response(*args, **kwargs)
        finally:
            self._between = True            # what comes next is a new request's headers

    def cut(self) -> None:
        # aiohttp's lingering read of the unread body, bounded: long enough for the client to
        # read the answer before the close (a close with its bytes unread is a reset, which
        # can reach the client before the answer), short enough that trickling holds nothing
        self._lingering_time = min(self._lingering_time, CUT_LINGER_S)

    def _arm(self) -> None:
        if self.header_timeout_s > 0 and self.transport is not None:
            self._deadline = self._loop.call_later(self.header_timeout_s, self._headers_due)

    def _headers_due(self) -> None:
        self._deadline = None
        if self._between and self.transport is not None:
            if self.limited is not None:
                self.limited.warning("header_timeout", "closing a connection that sent no "
                                     "complete request headers in %gs", self.header_timeout_s)
            self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)


def time_requests(server: Server) -> None:
    """Make `server` (an aiohttp server handing out `TimedHandler`s) tell each handler when a
    request's headers are complete (aiohttp has no hook for it but its request factory)."""
    make_request = server.request_factory

    def request_factory(message: Any, payload: Any, protocol: Any, writer: Any,
                        task: Any) -> Any:
        if isinstance(protocol, TimedHandler):
            protocol.request_started()
        return make_request(message, payload, protocol, writer, task)

    server.request_factory = request_factory
