"""Run the proxy until SIGTERM/SIGINT, then shut down in order, bounded in time:
stop accepting → answer queued requests 503 → let in-flight ones finish (up to
`shutdown_timeout_s`) → close connections → stop every backend (and its worker).

Start-up binds the listening port before anything else starts (no worker is spawned for a
prefixd that cannot listen), and SIGTERM/SIGINT are honoured from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from prefixd.backends.base import Backend
from prefixd.backends.supervision.parent import follow_parent, watch_parent
from prefixd.proxy.app import build_app
from prefixd.proxy.guard import Guard, GuardedRunner, raise_fd_limit
from prefixd.proxy.pipeline import Proxy
from prefixd.proxy.routing.policy import unserved_aliases
from prefixd.proxy.settings import Settings

log = logging.getLogger("prefixd.server")


class StartupError(Exception):
    """prefixd cannot start as configured (one readable line; exit status 2)."""


class ListenError(StartupError):
    """The proxy cannot listen on its address (in use, not permitted, unknown host)."""


def make_proxy(settings: Settings, backends: list[Backend]) -> Proxy:
    return Proxy(settings, backends, {b.name: b for b in settings.backends})


def listen(host: str, port: int) -> list[socket.socket]:
    """Bound sockets for every address of `host` (as asyncio would bind them), or
    ListenError with one readable line."""
    where = f"cannot listen on {host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenError(f"{where}: {_reason(e)}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:        # one port for every address
                addr = (addr[0], sockets[0].getsockname()[1], *addr[2:])
            sock.bind(addr)
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise ListenError(f"{where}: {_reason(e)}") from None
    return sockets


def _reason(e: OSError) -> str:
    text = e.strerror or str(e)
    return text[:1].lower() + text[1:]


class Server:
    """A started proxy on a real socket (used by the CLI and by tests)."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.app = build_app(proxy)
        s = proxy.settings
        self.runner = GuardedRunner(self.app, Guard(s.max_connections, s.header_timeout_s),
                                    handler_cancellation=True, access_log=None,
                                    shutdown_timeout=1.0)
        self.port: int | None = None
        self._sockets: list[socket.socket] = []

    async def start(self, host: str, port: int) -> int:
        return await self.start_on(listen(host, port))

    async def start_on(self, sockets: list[socket.socket]) -> int:
        """Serve on already bound `sockets` (the app's start-up starts the backends)."""
        self._sockets = sockets
        self.port = sockets[0].getsockname()[1]
        await self.runner.setup()
        for sock in sockets:
            await web.SockSite(self.runner, sock).start()
        return self.port

    async def shutdown(self, timeout_s: float) -> None:
        for site in list(self.runner.sites):
            await site.stop()                       # stop accepting
        queued = sum(q.close() for q in self.proxy.queues.values())
        if queued:
            log.info("shutdown: answered %d queued request(s) 503", queued)
        waits = [q.wait_idle() for q in self.proxy.queues.values()]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), timeout_s)
        except TimeoutError:
            log.warning("shutdown: in-flight requests still running after %.0fs; cutting them",
                        timeout_s)
            await self.proxy.cut_inflight()
        await self.runner.cleanup()                 # closes connections, stops backends
        for sock in self._sockets:                  # bound but never served (start cut short)
            sock.close()


async def serve(settings: Settings, backends: list[Backend]) -> int:
    """Serve until SIGTERM/SIGINT (or the parent tool's death). ListenError, before anything
    starts, when the address cannot be listened on."""
    raise_fd_limit()
    parent = follow_parent()          # set when a tool (e.g. `prefixd demo`) started us
    sockets = listen(settings.host, settings.port)
    proxy = make_proxy(settings, backends)
    problems = unserved_aliases(settings.model_aliases, proxy.index)
    if settings.cache_isolation == "per_key":
        shared = [b.name for b in backends if not b.capabilities.partitions_cache]
        if shared:
            log.warning("PREFIXD_CACHE_ISOLATION=per_key: the prompt caches of %s are their "
                        "servers' own and shared by every key (only prefixd workers keep "
                        "keys apart)", ", ".join(shared))
    if proxy.pool is not None:
        problems += proxy.pool.check()
    if problems:
        for sock in sockets:
            sock.close()
        raise StartupError("; ".join(problems))
    server = Server(proxy)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(watch_parent(parent, stop)) if parent else None
    try:
        if await _started(server.start_on(sockets), stop):
            log.info("prefixd listening on http://%s:%d (backends: %s)", settings.host,
                     server.port, ", ".join(f"{b.name}[{','.join(b.models)}]"
                                            for b in backends))
            await stop.wait()
        log.info("shutting down")
    finally:
        if watcher is not None:
            watcher.cancel()
        await server.shutdown(settings.shutdown_timeout_s)
    log.info("stopped")
    return 0


async def _started(start: Coroutine[Any, Any, int], stop: asyncio.Event) -> bool:
    """Run the start-up unless `stop` is set first (then cut it short): True when started."""
    starting = asyncio.ensure_future(start)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
    if starting.cancelled():
        return False
    starting.result()                 # raises a start-up error
    return True
