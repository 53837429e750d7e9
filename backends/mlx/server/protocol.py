"""The worker's listening socket below the application: malformed HTTP (a request line, header or
body framing aiohttp refuses before any handler runs) answered as a JSON 400 in the OpenAI error
shape with one log line, never a traceback. A managed worker's stderr is the proxy's log, so
whoever reaches the worker's port must not be able to fill that log.

Owns: `WorkerRunner`, an `aiohttp.web.AppRunner` whose server hands out `WorkerHandler`s (a
deadline for every request's headers, `header_timeout_s`: slowloris); the
answer itself is `api/protocol.py`'s, as the proxy's own socket gives it (`proxy/guard.py`).
"""

from __future__ import annotations

import logging
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from prefixd.api.protocol import RateLimitedLog, TimedHandler, protocol_error, time_requests

log = logging.getLogger("prefixd.worker")


_malformed = RateLimitedLog(log)


class WorkerHandler(TimedHandler):
    """aiohttp's connection protocol, answering protocol errors in JSON without a traceback,
    with a deadline for every request's headers (`TimedHandler`)."""

    limited = _malformed

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        return protocol_error(request, status, exc, message, _malformed, "the worker")


class _WorkerServer(Server):
    header_timeout_s: float

    def __call__(self) -> RequestHandler:
        handler = WorkerHandler(self, loop=self._loop, **self._kwargs)
        handler.header_timeout_s = self.header_timeout_s
        return handler


class WorkerRunner(web.AppRunner):
    """The worker's runner; every request's headers are due within `header_timeout_s`."""

    def __init__(self, app: web.Application, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.header_timeout_s = header_timeout_s

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        # The same server, handing out WorkerHandlers (aiohttp has no factory hook for the
        # connection protocol; `proxy/guard.py` does the same).
        server.__class__ = _WorkerServer
        cast(_WorkerServer, server).header_timeout_s = self.header_timeout_s
        time_requests(server)
        return server
