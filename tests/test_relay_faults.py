"""A broken upstream never makes prefixd send a broken answer: the client gets a complete
stream, a clean error in the shape the response state allows, or an aborted connection —
never a second HTTP response inside the first, never a hang (issue 8 item 2, issue 9)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

CHAT = "/v1/chat/completions"


def url(proxy, path: str = CHAT) -> str:
    return f"http://127.0.0.1:{proxy.port}{path}"


def body(fake: dict, stream: bool = True) -> dict:
    return {"model": "fake", "stream": stream, "fake": fake,
            "messages": [{"role": "user", "content": "hi"}]}


def event(obj: object) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


GOOD = event({"choices": [{"index": 0, "delta": {"content": "ok"}}]})
DEEP = "[" * 100_000 + "]" * 100_000
MALFORMED = [
    event({"choices": 5}),
    event({"choices": [5, None, "x"]}),
    event({"choices": [{"delta": 7}]}),
    event({"choices": [{"delta": {"tool_calls": [{"index": "abc", "function": {"name": "f"}}]}}]}),
    event({"choices": [{"delta": {"tool_calls": [{"index": None, "function": "str"}]}}]}),
    "data: " + '{"choices": [{"delta": {"tool_calls": [{"index": 1e999}]}}]}' + "\n\n",
    event({"choices": [{"delta": {"tool_calls": "nope"}}]}),
    event({"choices": [{"delta": {"content": 5, "tool_calls": [7]}}], "usage": 3}),
    "data: " + DEEP + "\n\n",
    "data: {not json\n\n",
    "event: odd\nid: 1\n\n",
]


@pytest.fixture
async def proxy(upstream, start_proxy):
    return await start_proxy(upstream.url, backend={"request_timeout_s": 2.0})


@pytest.mark.parametrize("bad", MALFORMED, ids=range(len(MALFORMED)))
async def test_malformed_upstream_events_are_relayed_not_fatal(proxy, http, bad):
    raw = [GOOD, bad, GOOD, "data: [DONE]\n\n"]
    async with http.post(url(proxy), json=body({"raw": raw})) as r:
        assert r.status == 200
        data = await asyncio.wait_for(r.read(), 10)
    assert data.endswith(b"data: [DONE]\n\n") and b"HTTP/1.1" not in data
    assert data.count(b'"ok"') == 2


async def test_deep_json_from_a_non_streaming_upstream(proxy, http):
    raw = ['{"choices": ' + DEEP + "}"]
    async with http.post(url(proxy), json=body({"raw": raw, "content_type":
                                                "application/json"}, stream=False)) as r:
        assert r.status == 200
        assert await asyncio.wait_for(r.read(), 10) == raw[0].encode()


async def test_non_streaming_upstream_dropping_mid_body_aborts_the_client(proxy, http):
    half = '{"id": "c1", "object": "chat.completion", "choices": [{"message": {"content": "he'
    raw = [half]
    async with http.post(url(proxy), json=body({"raw": raw, "content_type": "application/json",
                                                "drop": True}, stream=False)) as r:
        assert r.status == 200 and r.content_type == "application/json"
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(r.read(), 10)


async def test_streaming_upstream_dropping_mid_stream_ends_with_an_error_event(proxy, http):
    async with http.post(url(proxy), json=body({"raw": [GOOD], "drop": True})) as r:
        assert r.status == 200
        data = await asyncio.wait_for(r.read(), 10)
    events = [e for e in data.split(b"\n\n") if e]
    assert json.loads(events[-2][6:])["error"]["code"] == "upstream_error"
    assert events[-1] == b"data: [DONE]"


@pytest.mark.parametrize("sep", ["\r\n", "\r"])
async def test_crlf_framed_sse_streams_event_by_event(upstream, proxy, http, sep):
    """Valid SSE with CRLF (or CR) line ends is relayed as it arrives, and the usage that
    prefixd asked for is still removed for a client that did not ask for it."""
    first = GOOD.replace("\n", sep)
    usage = event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    raw = [first, usage.replace("\n", sep), "data: [DONE]" + sep + sep]
    r = await http.post(url(proxy), json=body({"raw": raw, "hold_after_first": True}))
    got = b""
    while b"ok" not in got:                  # arrives while the upstream still holds
        got += await asyncio.wait_for(r.content.readany(), 10)
    upstream.release.set()
    got += await asyncio.wait_for(r.read(), 10)
    r.release()
    assert b"usage" not in got and got.endswith(b"data: [DONE]\n\n")


async def test_upstream_that_never_answers_is_a_504(proxy, http):
    async with http.post(url(proxy), json=body({"hang_headers": True}, stream=False)) as r:
        assert r.status == 504
        err = (await r.json())["error"]
    assert err["code"] == "upstream_timeout" and "'up'" in err["message"]


def test_an_endless_event_is_refused_after_max_event_bytes():
    """An upstream event with no blank line is scanned once per byte (not once per chunk
    per buffered byte: 80 MB used to cost 11 s) and refused past MAX_EVENT_BYTES."""
    from prefixd.proxy.sse import MAX_EVENT_BYTES, SSERecorder, UpstreamProtocolError

    rec = SSERecorder(strip_usage=True)
    chunk = b"data: " + b"x" * (64 * 1024)
    with pytest.raises(UpstreamProtocolError):
        for _ in range(MAX_EVENT_BYTES // len(chunk) + 2):
            assert rec.feed(chunk) == b""
    assert rec._scanned <= MAX_EVENT_BYTES + 2 * len(chunk)
