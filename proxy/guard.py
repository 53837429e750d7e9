"""Connection-level protection of the listening socket, below the application: a cap on open
connections, a deadline for a new connection's first request headers (slowloris), a raised
file-descriptor limit, and protocol errors (a malformed request line or header that aiohttp
refuses before any handler runs) answered in the OpenAI error shape instead of plain text.

`GuardedRunner` is an `aiohttp.web.AppRunner` whose server hands out `GuardedHandler`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from prefixd.api.errors import error_body, status_type

log = logging.getLogger("prefixd.guard")


@dataclass(frozen=True)
class Guard:
    max_connections: int
    header_timeout_s: float


class RateLimitedLog:
    """Log one line per `key` at most every `every_s` seconds (an attack must not fill the
    disk with log lines), counting what was left out."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        last, skipped = self._last.get(key, (-self.every_s, 0))
        if now - last < self.every_s:
            self._last[key] = (last, skipped + 1)
            return
        self._last[key] = (now, 0)
        suffix = f" ({skipped} more since the last such line)" if skipped else ""
        log.warning(msg + suffix, *args)


_limited = RateLimitedLog()


class GuardedHandler(RequestHandler):
    """aiohttp's connection protocol with a connection cap, a first-headers deadline and
    JSON protocol errors."""

    _started = False
    _deadline: asyncio.TimerHandle | None = None

    @property
    def _server(self) -> GuardedServer:
        # the handler's server is always ours (GuardedRunner made it); aiohttp types it as
        # Server | None
        return cast(GuardedServer, self._manager)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        server = self._server
        guard = server.guard
        if len(server.connections) > guard.max_connections:
            _limited.warning("max_connections", "refusing a connection: %d open "
                             "(PREFIXD_MAX_CONNECTIONS=%d)", len(server.connections),
                             guard.max_connections)
            transport.close()
            return
        self._deadline = self._loop.call_later(guard.header_timeout_s, self._first_headers_due)

    def request_started(self) -> None:
        self._started = True
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _first_headers_due(self) -> None:
        if not self._started and self.transport is not None:
            _limited.warning("header_timeout", "closing a connection that sent no complete "
                             "request headers in %gs", self._server.guard.header_timeout_s)
            self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        if status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
            text = "internal error in prefixd (see its log)"
        else:
            _limited.warning(f"protocol:{status}", "bad request from %s: %s", request.remote,
                             message or exc)
            text = f"malformed HTTP request: {message or exc or 'bad request'}"
        body = error_body(text, status_type(status), code="bad_request" if status < 500
                          else "internal_error")
        resp = web.Response(status=status, text=json.dumps(body), content_type="application/json")
        resp.force_close()
        return resp


class GuardedServer(Server):
    guard: Guard

    def __call__(self) -> RequestHandler:
        return GuardedHandler(self, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    def __init__(self, app: web.Application, guard: Guard, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.guard = guard

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        # The same server, handing out GuardedHandlers (aiohttp has no factory hook for the
        # connection protocol); it tells each handler when its first request started.
        server.__class__ = GuardedServer
        cast(GuardedServer, server).guard = self.guard
        make_request = server.request_factory

        def request_factory(message: Any, payload: Any, protocol: Any, writer: Any,
                            task: Any) -> Any:
            if isinstance(protocol, GuardedHandler):
                protocol.request_started()
            return make_request(message, payload, protocol, writer, task)

        server.request_factory = request_factory
        return server


def raise_fd_limit(wanted: int = 65536) -> int:
    """Raise the soft open-files limit towards the hard limit (macOS defaults to 256, Linux
    to 1024); returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
