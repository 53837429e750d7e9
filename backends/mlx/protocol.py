"""The worker's listening socket below the application: malformed HTTP (a request line, header or
body framing aiohttp refuses before any handler runs) answered as a JSON 400 in the OpenAI error
shape with one log line, never a traceback. A managed worker's stderr is the proxy's log, so
whoever reaches the worker's port must not be able to fill that log.

Owns: `WorkerRunner`, an `aiohttp.web.AppRunner` whose server hands out `WorkerHandler`s. The
proxy does the same for its own socket (`proxy/guard.py`), which the worker cannot import.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from prefixd.api.errors import error_response

log = logging.getLogger("prefixd.worker")
MESSAGE_CHARS = 200          # of aiohttp's reason, which may quote the bytes it refused


class _Limited:
    """One warning per `every_s` seconds at most; the next one says how many were left out."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s, self._last, self._skipped = every_s, -every_s, 0

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._skipped += 1
            return
        skipped, self._last, self._skipped = self._skipped, now, 0
        log.warning(msg + (f" ({skipped} more since the last such line)" if skipped else ""),
                    *args)


_malformed = _Limited()


class WorkerHandler(RequestHandler):
    """aiohttp's connection protocol, answering protocol errors in JSON without a traceback."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        if status >= 500:       # our own failure, not the client's: the traceback is wanted
            log.error("worker: error handling a request from %s", request.remote, exc_info=exc)
            text, code = "internal error in the worker (see its log)", "internal_error"
        else:
            # aiohttp's reason spans lines (it points at the byte): one line, bounded
            reason = " ".join(str(message or exc or "bad request").split())[:MESSAGE_CHARS]
            _malformed.warning("worker: malformed HTTP from %s: %s", request.remote, reason)
            text, code = f"malformed HTTP request: {reason}", "bad_request"
        resp = error_response(status, text, code=code)
        resp.force_close()
        return resp


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
