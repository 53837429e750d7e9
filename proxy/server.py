"""Run the proxy until SIGTERM/SIGINT, then shut down in order, bounded in time:
stop accepting → answer queued requests 503 → let in-flight ones finish (up to
`shutdown_timeout_s`) → close connections → stop every backend (and its worker)."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from prefixd.backends.base import Backend
from prefixd.backends.parent import follow_parent, watch_parent
from prefixd.proxy.app import build_app
from prefixd.proxy.guard import Guard, GuardedRunner, raise_fd_limit
from prefixd.proxy.pipeline import Proxy
from prefixd.proxy.settings import Settings

log = logging.getLogger("prefixd.server")


def make_proxy(settings: Settings, backends: list[Backend]) -> Proxy:
    return Proxy(settings, backends, {b.name: b for b in settings.backends})


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

    async def start(self, host: str, port: int) -> int:
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
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


async def serve(settings: Settings, backends: list[Backend]) -> int:
    raise_fd_limit()
    server = Server(make_proxy(settings, backends))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = follow_parent()          # set when a tool (e.g. `prefixd demo`) started us
    watcher = asyncio.create_task(watch_parent(parent, stop)) if parent else None
    port = await server.start(settings.host, settings.port)
    log.info("prefixd listening on http://%s:%d (backends: %s)", settings.host, port,
             ", ".join(f"{b.name}[{','.join(b.models)}]" for b in backends))
    await stop.wait()
    if watcher is not None:
        watcher.cancel()
    log.info("shutting down")
    await server.shutdown(settings.shutdown_timeout_s)
    log.info("stopped")
    return 0
