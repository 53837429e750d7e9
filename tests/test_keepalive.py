"""Upstreams that close keep-alive connections under the proxy: a request that went out on a
pooled connection the upstream had already given up is sent again once (the upstream never
answered it), and never when the connection was new or after any response byte.

llama-server closes the connection after every streamed answer although its headers say
keep-alive; under load the next queued request takes that connection from the pool before the
close is read, and got a 502 "Can not write request body" (issue 17)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from proxy_fixtures import StartProxy

from prefixd.metrics import proxy as m

ANSWER = json.dumps({"id": "chatcmpl-ka", "object": "chat.completion", "model": "fake",
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": "ok"}}]}).encode()


class RawUpstream:
    """A raw HTTP/1.1 server on a loopback port; `_connection` serves one connection."""

    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class IdleClosingUpstream(RawUpstream):
    """A raw HTTP/1.1 server that advertises keep-alive but does not keep it, by `mode`:

    close_on_reuse   answers the first request of a connection; a second one on it is read
                     and the connection closed unanswered (an idle timeout firing just as the
                     client reuses the connection)
    reset_on_reuse   the same, but the connection is reset (RST) instead of closed
    close_after      closes right after each answer, still saying keep-alive
    drop_all         closes every connection after reading its request, never answering
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.answered = 0           # POSTs answered
        self.dropped = 0            # POSTs read and left unanswered

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                post = head.startswith(b"POST ")
                if self.mode == "reset_on_reuse" and served:
                    self.dropped += post
                    writer.transport.abort()        # unread body + abort: the peer gets RST
                    return
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if self.mode == "drop_all" or (self.mode == "close_on_reuse" and served):
                    self.dropped += post
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Connection: keep-alive\r\nKeep-Alive: timeout=60\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
                await writer.drain()
                self.answered += post
                served += 1
                if self.mode == "close_after":
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


class StreamClosingUpstream(RawUpstream):
    """A raw HTTP/1.1 server that behaves like llama-server with streams: it answers one
    request per connection with a chunked SSE stream whose headers say keep-alive, then
    closes the connection `turns_before_close` event-loop turns later, never reading the next
    request sent on it. Proxy, upstream and client share one event loop, so each value of
    `turns_before_close` puts the close at one fixed point of the proxy's next request."""

    EVENTS = (b'data: {"id":"chatcmpl-ka","object":"chat.completion.chunk","model":"fake",'
              b'"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n', b"data: [DONE]\n\n")

    def __init__(self) -> None:
        self.turns_before_close = 0
        self.answered = 0           # POSTs answered

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\nKeep-Alive: timeout=5, max=100\r\n\r\n"
                         + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in self.EVENTS)
                         + b"0\r\n\r\n")
            self.answered += head.startswith(b"POST ")     # not the health probes
            for _ in range(self.turns_before_close):
                await asyncio.sleep(0)
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


StartUpstream = Callable[[str], Awaitable[IdleClosingUpstream]]


@pytest.fixture
async def idle_closing() -> AsyncIterator[StartUpstream]:
    started: list[IdleClosingUpstream] = []

    async def start(mode: str) -> IdleClosingUpstream:
        up = IdleClosingUpstream(mode)
        await up.start()
        started.append(up)
        return up

    yield start
    for up in started:
        await up.stop()


def body(i: int) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": f"turn {i}"}]}


@pytest.mark.parametrize("mode", ["close_on_reuse", "reset_on_reuse", "close_after"])
async def test_requests_on_connections_the_upstream_closed_all_succeed(
        mode: str, idle_closing: StartUpstream, start_proxy: StartProxy,
        http: aiohttp.ClientSession) -> None:
    up = await idle_closing(mode)
    server = await start_proxy(up.url)
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    statuses = []
    for i in range(12):                         # one after another: the pool is reused
        async with http.post(url, json=body(i)) as r:
            statuses.append(r.status)
            assert (await r.json())["choices"][0]["message"]["content"] == "ok"
    assert statuses == [200] * 12               # zero failures
    assert up.answered == 12                    # none answered twice
    if mode != "close_after":                   # the race was really run
        assert up.dropped > 0


async def test_a_new_connection_dropped_is_not_sent_again(
        idle_closing: StartUpstream, start_proxy: StartProxy,
        http: aiohttp.ClientSession) -> None:
    """On a fresh connection, a drop may mean the upstream died working on it: 502, once."""
    up = await idle_closing("drop_all")
    server = await start_proxy(up.url)
    async with http.post(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                         json=body(0)) as r:
        assert r.status == 502
        assert (await r.json())["error"]["code"] == "upstream_error"
    assert up.dropped == 1 and up.answered == 0


async def test_streams_from_an_upstream_that_closes_after_each_stream_all_succeed(
        start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    """Three streams at once on one slot: each queued one goes out as the previous ends, on
    the connection the upstream is closing. Moving the close over the next request's path
    hits each way it fails: disconnected, reset, and the transport closing while the body
    is written ("Can not write request body", once a 502). Every stream completes, each
    request is answered once."""
    up = StreamClosingUpstream()
    await up.start()
    try:
        server = await start_proxy(up.url)
        url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
        resent = m.UPSTREAM_RESENDS.labels("up")._value.get()

        async def stream(i: int) -> bytes:
            async with http.post(url, json={**body(i), "stream": True}) as r:
                assert r.status == 200
                return await r.read()

        sent = 0
        for turns in range(24):
            up.turns_before_close = turns
            answers = await asyncio.gather(*(stream(i) for i in range(3)))
            sent += len(answers)
            for a in answers:
                assert b'"ok"' in a and a.endswith(b"data: [DONE]\n\n"), a[-300:]
        assert up.answered == sent                  # none lost, none answered twice
        assert m.UPSTREAM_RESENDS.labels("up")._value.get() > resent   # the race was run
    finally:
        await up.stop()
