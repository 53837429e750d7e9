"""Every request body has a read deadline (issue 33 item 4): a client that sends its headers,
the worker's token among them, and then trickles its body (slowloris) is answered 408
`request_timeout` after `body_timeout_s` and its connection closed, on a worker's prefix-state
import (streamed), its other routes, and the proxy's routes (count_tokens included); several
such connections at once are all cut, and the worker serves a normal request after.

The worker is the real app (`create_app`, with a token and a transfer secret) on a real
loopback socket under the worker's own runner, around a loaded tiny Qwen3; the proxy is a real
one in front of the fake upstream. Waits are bounded; no timing is asserted."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.server import seal
from prefixd.backends.mlx.server.app import create_app
from prefixd.backends.mlx.server.protocol import WorkerRunner
from prefixd.backends.mlx.settings import WorkerSettings
from tests.worker_fixtures import loaded

TOKEN = "the-workers-token-0123"
DEADLINE_S = 0.5
BOUND_S = 60.0            # a generous bound on every wait: a hang fails, nothing is timed


@pytest.fixture(scope="module")
def generator(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[Generator]:
    settings = WorkerSettings(_env_file=None, use_system_blas=False, disk_cache_bytes=0,
                              cache_dir=tmp_path_factory.mktemp("cache"),
                              transfer_secret="the transfer secret of the test")
    gen = Generator(settings)
    loaded(gen, str(tiny_model_dir("qwen3")))
    yield gen
    gen.close()


@pytest.fixture
async def worker(generator: Generator, tmp_path: Path) -> AsyncIterator[int]:
    """The worker's port: its app with a token, `body_timeout_s` short."""
    settings = generator.settings.model_copy(update={"body_timeout_s": DEADLINE_S})
    runner = WorkerRunner(create_app(generator, "tiny", settings, TOKEN), DEADLINE_S,
                          handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def _head(path: str, length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n{extra}\r\n"
            ).encode()


async def slowloris(port: int, head: bytes) -> tuple[int, dict, bool]:
    """Send `head`, then one body byte every 0.05 s until the server answers (at most
    BOUND_S): (status, JSON body, whether the server then closed the connection)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            for _ in range(int(BOUND_S / 0.05)):
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.05)

    dripping = asyncio.create_task(trickle())
    try:
        writer.write(head + b"{")
        status_line = await asyncio.wait_for(reader.readline(), BOUND_S)
        assert status_line, "the connection closed without an answer"
        headers = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)
        length = int(next(h.split(b":")[1] for h in headers.split(b"\r\n")
                          if h.lower().startswith(b"content-length")))
        body = json.loads(await asyncio.wait_for(reader.readexactly(length), BOUND_S))
        dripping.cancel()
        closed = await asyncio.wait_for(reader.read(), BOUND_S) == b""
        return int(status_line.split()[1]), body, closed
    finally:
        dripping.cancel()
        writer.close()


async def test_a_trickled_import_holding_the_token_is_cut(worker: int) -> None:
    mac = f"{seal.HEADER}: {'0' * 64}\r\n"
    cuts = await asyncio.gather(*(slowloris(worker, _head("/v1/cache/import", 1 << 20, mac))
                                  for _ in range(5)))
    for status, body, closed in cuts:
        assert status == 408 and body["error"]["code"] == "request_timeout", body
        assert closed


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/v1/cache/export"])
async def test_a_trickled_body_on_any_worker_route_is_cut(worker: int, path: str) -> None:
    status, body, closed = await slowloris(worker, _head(path, 4096))
    assert status == 408 and body["error"]["code"] == "request_timeout", body
    assert closed


async def test_the_worker_serves_normally_after_the_cuts(worker: int) -> None:
    await slowloris(worker, _head("/v1/cache/import", 1 << 20, f"{seal.HEADER}: {'0' * 64}\r\n"))
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    reader, writer = await asyncio.open_connection("127.0.0.1", worker)
    try:
        writer.write(_head("/v1/chat/completions", len(body)) + body.encode())
        assert b" 200 " in await asyncio.wait_for(reader.readline(), BOUND_S)
    finally:
        writer.close()


@pytest.mark.parametrize("path", ["/v1/messages/count_tokens", "/v1/chat/completions",
                                  "/v1/messages", "/v1/responses"])
async def test_a_trickled_body_on_any_proxy_route_is_cut(upstream, start_proxy,
                                                         path: str) -> None:
    proxy = await start_proxy(upstream.url, body_timeout_s=DEADLINE_S)
    status, body, closed = await slowloris(proxy.port, _head(path, 4096))
    assert status == 408, body
    assert closed


# --- headers: a deadline for every request on a connection, not only its first ----------------
def _chat_request() -> bytes:
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2})
    return _head("/v1/chat/completions", len(body)) + body.encode()


async def _answered(reader: asyncio.StreamReader) -> int:
    """Read one whole answer (a Content-Length or chunks) off a keep-alive connection."""
    status = int((await asyncio.wait_for(reader.readline(), BOUND_S)).split()[1])
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)).lower()
    if b"transfer-encoding: chunked" in head:
        await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), BOUND_S)
        return status
    length = int(next(h.split(b":")[1] for h in head.split(b"\r\n")
                      if h.startswith(b"content-length")))
    await asyncio.wait_for(reader.readexactly(length), BOUND_S)
    return status


async def _closed_after(port: int, first: bytes | None, idle_s: float = 0.0) -> bool:
    """On one connection: `first` (a whole request, answered), an idle pause, then half a
    request's headers trickled: whether the server closes the connection (within BOUND_S)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if first is not None:
            writer.write(first)
            assert await _answered(reader) == 200
        await asyncio.sleep(idle_s)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(int(BOUND_S / 0.05)):
            with contextlib.suppress(ConnectionError):
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1 << 16), 0.05) == b"":
                    return True
            except TimeoutError:
                continue
        return False
    finally:
        writer.close()


async def test_a_worker_cuts_trickled_headers_first_or_later(worker: int) -> None:
    assert await _closed_after(worker, None)
    assert await _closed_after(worker, _chat_request(), idle_s=DEADLINE_S * 2)


async def test_the_proxy_cuts_a_later_requests_trickled_headers(upstream, start_proxy) -> None:
    proxy = await start_proxy(upstream.url, header_timeout_s=DEADLINE_S)
    assert await _closed_after(proxy.port, _chat_request(), idle_s=DEADLINE_S * 2)


async def test_an_idle_keep_alive_connection_is_not_a_slow_one(upstream, start_proxy) -> None:
    """The header deadline counts from a request's first byte: a pooled connection idle for
    longer than it still serves its next request."""
    proxy = await start_proxy(upstream.url, header_timeout_s=DEADLINE_S)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        for _ in range(2):
            writer.write(_chat_request())
            assert await _answered(reader) == 200
            await asyncio.sleep(DEADLINE_S * 3)
    finally:
        writer.close()
