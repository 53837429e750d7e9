"""Connection-level protection of the listening socket, below the application: a cap on open
connections, a deadline for every request's headers (slowloris: `api/protocol.TimedHandler`),
a raised file-descriptor limit, and protocol errors (a malformed request line or header that aiohttp
refuses before any handler runs) answered in the OpenAI error shape instead of plain text.

`GuardedRunner` is an `aiohttp.web.AppRunner` whose server hands out `GuardedHandler`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from prefixd.api.protocol import RateLimitedLog, TimedHandler, protocol_error, time_requests

log = logging.getLogger("prefixd.guard")


@dataclass(frozen=True)
class Guard:
    max_connections: int
    header_timeout_s: float


_limited = RateLimitedLog(log)


class GuardedHandler(TimedHandler):
    """aiohttp's connection protocol with a connection cap, a deadline for every request's
    headers (`TimedHandler`) and JSON protocol errors."""

    limited = _limited

    @property
    def _server(self) -> GuardedServer:
        # the handler's server is always ours (GuardedRunner made it); aiohttp types it as
        # Server | None
        return cast(GuardedServer, self._manager)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._server
        guard = server.guard
        self.header_timeout_s = guard.header_timeout_s
        super().connection_made(transport)
        if len(server.connections) > guard.max_connections:
            _limited.warning("max_connections", "refusing a connection: %d open "
                             "(PREFIXD_MAX_CONNECTIONS=%d)", len(server.connections),
                             guard.max_connections)
            transport.close()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        return protocol_error(request, status, exc, message, _limited, "prefixd")


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
        time_requests(server)
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
