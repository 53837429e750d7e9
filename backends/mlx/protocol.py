"""The worker's listening socket below the application: malformed HTTP (a request line, header or
body framing aiohttp refuses before any handler runs) answered as a JSON 400 in the OpenAI error
shape with one log line, never a traceback. A managed worker's stderr is the proxy's log, so
whoever reaches the worker's port must not be able to fill that log.

Owns: `WorkerRunner`, an `aiohttp.web.AppRunner` whose server hands out `WorkerHandler`s; the
answer itself is `api/protocol.py`'s, as the proxy's own socket gives it (`proxy/guard.py`).
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from prefixd.api.protocol import Cuttable, RateLimitedLog, protocol_error

log = logging.getLogger("prefixd.worker")


_malformed = RateLimitedLog(log)


class WorkerHandler(Cuttable):
    """aiohttp's connection protocol, answering protocol errors in JSON without a traceback."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        return protocol_error(request, status, exc, message, _malformed, "the worker")


class _WorkerServer(Server):
    def __call__(self) -> RequestHandler:
        return WorkerHandler(self, loop=self._loop, **self._kwargs)


class WorkerRunner(web.AppRunner):
    async def _make_server(self) -> Server:
        server = await super()._make_server()
        # The same server, handing out WorkerHandlers (aiohttp has no factory hook for the
        # connection protocol; `proxy/guard.py` does the same).
        server.__class__ = _WorkerServer
        return server
