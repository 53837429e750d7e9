"""Fixtures for proxy tests: a fake upstream and a real prefixd proxy on loopback ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from fake_upstream import FakeUpstream

from prefixd.backends.registry import build_backends
from prefixd.proxy.server import Server, make_proxy
from prefixd.proxy.settings import Settings


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    up = FakeUpstream()
    await up.start()
    try:
        yield up
    finally:
        up.release.set()
        await up.stop()


StartProxy = Callable[..., Awaitable[Server]]


async def read_until(resp: aiohttp.ClientResponse, marker: bytes) -> bytes:
    """Read a streamed body until `marker` shows up; fail if the stream ends first."""
    seen = b""
    async for chunk in resp.content.iter_any():
        seen += chunk
        if marker in seen:
            return seen
    raise AssertionError(f"stream ended without {marker!r}: {seen[-300:]!r}")


@pytest.fixture
async def start_proxy() -> AsyncIterator[StartProxy]:
    """start_proxy(upstream_url, backend={...overrides}, **settings) -> a started Server."""
    servers: list[Server] = []

    async def start(url: str | None = None, backend: dict[str, Any] | None = None,
                    backends: list[dict[str, Any]] | None = None, **fields: Any) -> Server:
        if backends is None:
            backends = [{"name": "up", "kind": "openai", "url": url, "models": ["fake"],
                         **(backend or {})}]
        settings = Settings(_env_file=None, backends=backends, **fields)
        server = Server(make_proxy(settings, build_backends(settings.backends, settings)))
        await server.start("127.0.0.1", 0)
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for s in servers:
            await s.shutdown(1.0)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s
