"""An answer cut short is never reported as complete (issue 25 item 1): whatever stopped the
backend and however it said so, each client API reports the stop its own way — chat an error
event and then `data: [DONE]`, Messages an `error` event (no `message_stop`), Responses
`response.failed` (never `response.completed`) — and the request is logged as failed.

The upstream's wire behaviour for each way a worker stops, played by the fake upstream:
- `term`: it said so in-band (a worker stopped by SIGTERM, or one stopped and continued after
  its supervisor gave up on it, ends its stream with an error event and closes it);
- `eof`: the stream ended cleanly with neither a finish reason nor `[DONE]`;
- `kill`: the connection dropped mid-stream (SIGKILL);
- `error_first`: an in-band error before any content;
- `abort`: a finish reason that names a stop (vLLM's `abort` for a request it aborted), then
  `[DONE]`.
The same through a real worker process stopped by signals: `test_worker_stops.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

CHUNK = {"id": "c1", "object": "chat.completion.chunk", "model": "fake",
         "choices": [{"index": 0, "delta": {"content": "partial "}, "finish_reason": None}]}
ROLE = {**CHUNK, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
STOPPED = {"error": {"message": "the worker stopped this generation (shutting down)",
                     "type": "server_error", "param": None, "code": None}}


def data(obj: object) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


STOPS = {
    "term": {"raw": [data(ROLE), data(CHUNK), data(CHUNK), data(STOPPED)]},
    "eof": {"raw": [data(ROLE), data(CHUNK), data(CHUNK)]},
    "kill": {"raw": [data(ROLE), data(CHUNK), data(CHUNK)], "drop": True},
    "error_first": {"raw": [data(ROLE), data(STOPPED)]},
    "abort": {"raw": [data(ROLE), data(CHUNK), data({**CHUNK, "choices": [
        {"index": 0, "delta": {}, "finish_reason": "abort"}]}), "data: [DONE]\n\n"]},
}
APIS = {
    "chat": ("/v1/chat/completions",
             {"model": "fake", "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
    "messages": ("/v1/messages",
                 {"model": "fake", "stream": True, "max_tokens": 100,
                  "messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", {"model": "fake", "stream": True, "input": "hi"}),
}


def sse_events(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE event; comments dropped."""
    out = []
    for block in raw.decode().split("\n\n"):
        name, lines = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                lines.append(line[5:].strip())
        if lines:
            out.append((name, "\n".join(lines)))
    return out


def assert_cut_short(api: str, events: list[tuple[str | None, str]]) -> None:
    names = [n for n, _ in events]
    payloads = [d for _, d in events]
    if api == "chat":
        assert payloads[-1] == "[DONE]", payloads
        error = json.loads(payloads[-2])["error"]
        assert error["message"] and error["type"]
        finishes = [c.get("finish_reason") for p in payloads[:-2]
                    for c in json.loads(p).get("choices", [])]
        assert not any(finishes), finishes           # no choice claims to have finished
    elif api == "messages":
        assert names[-1] == "error", names
        assert "message_stop" not in names
        assert not any('"end_turn"' in d for d in payloads)
    else:
        assert names[-1] == "response.failed", names
        assert "response.completed" not in names and "response.incomplete" not in names
        assert json.loads(payloads[-1])["response"]["status"] == "failed"


@pytest.mark.parametrize("stop", sorted(STOPS))
@pytest.mark.parametrize("api", sorted(APIS))
async def test_a_stopped_answer_is_reported_as_cut_short(api, stop, upstream, start_proxy, http,
                                                         caplog):
    caplog.set_level(logging.INFO, logger="prefixd.request")
    proxy = await start_proxy(upstream.url)
    path, body = APIS[api]
    upstream.scripted.append(dict(STOPS[stop]))
    async with http.post(f"http://127.0.0.1:{proxy.port}{path}", json=body) as r:
        raw = await r.read()
    assert r.status == 200
    assert_cut_short(api, sse_events(raw))
    if stop != "error_first":                         # what was sent before the stop stays
        assert b"partial" in raw
    lines = [rec.getMessage() for rec in caplog.records
             if rec.getMessage().startswith("request ")]
    assert len(lines) == 1 and "status=502" in lines[0], lines


@pytest.mark.parametrize("api", sorted(APIS))
async def test_a_stream_that_ends_before_any_answer_is_sent_again(api, upstream, start_proxy,
                                                                  http):
    """A stream that ended with nothing of the answer (neither content nor an end) was not an
    answer: another backend of the model gives it whole, with no error and one start."""
    proxy = await start_proxy(backends=[
        {"name": n, "kind": "openai", "url": upstream.url, "models": ["fake"]}
        for n in ("a", "b")])
    path, body = APIS[api]
    upstream.scripted += [{"raw": [data(ROLE)]}, {}]    # the retry gets a whole answer
    async with http.post(f"http://127.0.0.1:{proxy.port}{path}", json=body) as r:
        raw = await r.read()
    assert r.status == 200 and len(upstream.received) == 2
    events = sse_events(raw)
    assert all(n not in ("error", "response.failed") for n, _ in events)
    assert not any('"error": {' in d or '"error":{' in d for _, d in events)


async def test_a_complete_stream_without_done_is_still_complete(upstream, start_proxy, http):
    """An upstream that ends with a finish reason but omits `[DONE]` answered whole."""
    proxy = await start_proxy(upstream.url)
    end = {**CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    upstream.scripted.append({"raw": [data(ROLE), data(CHUNK), data(end)]})
    path, body = APIS["messages"]
    async with http.post(f"http://127.0.0.1:{proxy.port}{path}", json=body) as r:
        names = [n for n, _ in sse_events(await r.read())]
    assert names[-1] == "message_stop" and "error" not in names


async def test_a_queued_stream_gets_the_backends_4xx_as_it_said_it(upstream, start_proxy, http):
    """A streamed request that waited in the queue (its SSE response already started) gets a
    backend's 4xx with the parameter and code the backend named, as an unqueued one does."""
    proxy = await start_proxy(upstream.url)
    url = f"http://127.0.0.1:{proxy.port}/v1/chat/completions"
    hold = {"model": "fake", "messages": [{"role": "user", "content": "a"}],
            "fake": {"hold": True}}
    bad = {"message": "n must be 1", "type": "invalid_request_error", "param": "n",
           "code": "unsupported_value"}
    queued = {"model": "fake", "stream": True, "messages": [{"role": "user", "content": "b"}],
              "fake": {"status": 400, "error": bad}}
    async def held() -> bytes:
        async with http.post(url, json=hold) as r:
            return await r.read()

    first = asyncio.create_task(held())
    await upstream.wait_received(1)
    async with http.post(url, json=queued) as r:
        assert r.status == 200                   # its SSE response started while it waited
        await r.content.readuntil(b"\n\n")     # a queue position
        upstream.release.set()
        raw = await r.read()
    await first
    events = [d for _, d in sse_events(raw)]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["param"] == "n" and error["code"] == "unsupported_value"
    assert error["type"] == "invalid_request_error"
