"""Hostile and broken clients get a 4xx in the OpenAI error shape (never a 5xx, plain text or
a hang), cannot exhaust connections, cannot forge log lines, and an answer cut by shutdown
still ends cleanly (issue 9)."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging

import pytest

CHAT = "/v1/chat/completions"
HELLO = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


def url(proxy, path: str = CHAT) -> str:
    return f"http://127.0.0.1:{proxy.port}{path}"


def openai_error(data: bytes) -> dict:
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


async def raw_request(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes on a fresh connection; everything the server answers until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def split_http(answer: bytes) -> tuple[int, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


@pytest.fixture
async def proxy(upstream, start_proxy):
    return await start_proxy(upstream.url, max_body_bytes=4096, header_timeout_s=0.5,
                             max_connections=8)


async def test_chunked_body_over_the_limit_is_413(proxy, http):
    async def chunks():
        for _ in range(10):
            yield b" " * 1000
    async with http.post(url(proxy), data=chunks(),
                         headers={"Content-Type": "application/json"}) as r:
        assert r.status == 413
        assert openai_error(await r.read())["code"] == "request_too_large"


@pytest.mark.parametrize("size", [5000, 2_000_000])
async def test_gzip_body_inflating_past_the_limit_is_413(proxy, http, size):
    body = json.dumps({**HELLO, "pad": " " * size}).encode()
    async with http.post(url(proxy), data=gzip.compress(body),
                         headers={"Content-Type": "application/json",
                                  "Content-Encoding": "gzip"}) as r:
        assert r.status == 413
        assert openai_error(await r.read())["code"] == "request_too_large"
    async with http.get(url(proxy, "/health")) as r:
        assert r.status == 200


async def test_a_gzip_body_within_the_limit_works(proxy, http):
    async with http.post(url(proxy), data=gzip.compress(json.dumps(HELLO).encode()),
                         headers={"Content-Type": "application/json",
                                  "Content-Encoding": "gzip"}) as r:
        assert r.status == 200


@pytest.mark.parametrize("raw", [
    "\ufeff".encode() + json.dumps(HELLO).encode(),                 # UTF-8 BOM
    json.dumps(HELLO).encode("utf-16"),                             # UTF-16 with BOM
    json.dumps(HELLO).encode("utf-32-le"),
    b'{"model": "fake", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "fake", "messages": [{"role": "user", "content": "a\\udfffb"}]}',
    b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "seed": 1e400}',
    b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
])
async def test_bodies_that_are_not_text_or_not_numbers_are_400(proxy, http, raw):
    async with http.post(url(proxy), data=raw, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        openai_error(await r.read())


async def test_protocol_errors_are_json_in_the_openai_shape(proxy):
    port = proxy.port
    cases = [
        b"GARBAGE\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\nabc\r\n0\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20000 + b"\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    ]
    for data in cases:
        status, body = split_http(await raw_request(port, data))
        assert 400 <= status < 500, data[:60]
        assert openai_error(body)["type"] == "invalid_request_error"


async def test_non_utf8_authorization_is_401_not_500(upstream, start_proxy):
    proxy = await start_proxy(upstream.url, api_key="sekret")
    body = json.dumps(HELLO).encode()
    data = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    status, answer = split_http(await raw_request(proxy.port, data))
    assert status == 401 and openai_error(answer)["code"] == "invalid_api_key"


async def test_slow_headers_are_cut_and_connections_are_capped(proxy, http):
    """Trickling connections are closed after header_timeout_s; past max_connections a new
    one is closed at once; neither stops a normal request from being served after."""
    socks = []
    for _ in range(8):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")   # never ends
        socks.append((reader, writer))
    await asyncio.sleep(0.05)
    extra_r, extra_w = await asyncio.open_connection("127.0.0.1", proxy.port)
    assert await asyncio.wait_for(extra_r.read(), 5) == b""       # over the cap: closed
    extra_w.close()
    for reader, writer in socks:                                  # the deadline closes them
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    async with http.post(url(proxy), json=HELLO) as r:
        assert r.status == 200


async def test_client_values_cannot_forge_log_fields_or_lines(upstream, proxy, http, caplog):
    caplog.set_level(logging.INFO, logger="prefixd.request")
    forged = "abc status=200 backend=evil"
    async with http.post(url(proxy), json={**HELLO, "fake": {"status": 500}},
                         headers={"X-Request-Id": forged}) as r:
        assert r.status == 500 and r.headers["X-Request-Id"] != forged
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "prefixd.request"]
    assert lines and all("\n" not in line and "backend=evil" not in line for line in lines)


async def test_model_by_id(proxy, http):
    async with http.get(url(proxy, "/v1/models/fake")) as r:
        assert r.status == 200 and (await r.json())["id"] == "fake"
    async with http.get(url(proxy, "/v1/models/nope")) as r:
        assert r.status == 404
        err = openai_error(await r.read())
    assert err["code"] == "model_not_found" and "fake" in err["message"]


async def test_shutdown_that_runs_out_of_time_ends_streams_with_an_error(upstream, start_proxy,
                                                                       http):
    proxy = await start_proxy(upstream.url)
    r = await http.post(url(proxy), json={**HELLO, "stream": True,
                                          "fake": {"chunks": 3, "hold_after_first": True}})
    got = b""
    while b"tok0" not in got:
        got += await asyncio.wait_for(r.content.readany(), 10)
    await proxy.shutdown(0.2)
    got += await asyncio.wait_for(r.content.read(), 10)
    r.release()
    events = [e for e in got.split(b"\n\n") if e]
    assert json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
    assert events[-1] == b"data: [DONE]"
    upstream.release.set()
