"""Bad input gets a 4xx in the OpenAI error shape, never a 5xx, and the proxy keeps serving."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CHAT = "/v1/chat/completions"


def shape_ok(body: dict) -> bool:
    err = body.get("error")
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}


@pytest.fixture
async def proxy(upstream, start_proxy):
    return await start_proxy(upstream.url, max_body_bytes=4096)


CASES = [
    (CHAT, b"{not json", 400, "invalid_json"),
    (CHAT, b"[1, 2]", 400, "invalid_body"),
    (CHAT, b'"text"', 400, "invalid_body"),
    (CHAT, b'{"model": "fake"}', 400, "missing_field"),
    (CHAT, b'{"model": "fake", "messages": "hi"}', 400, "invalid_type"),
    (CHAT, b'{"model": "fake", "messages": []}', 400, "invalid_value"),
    (CHAT, b'{"model": "fake", "messages": [{"content": "x"}]}', 400, "missing_field"),
    (CHAT, b'{"model": "fake", "messages": [{"role": "user", "content": 5}]}', 400,
     "invalid_type"),
    (CHAT, b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', 400,
     "invalid_type"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400,
     "invalid_type"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', 400,
     "invalid_value"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": true}', 400,
     "invalid_type"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stop": [1]}', 400,
     "invalid_type"),
    ("/v1/completions", b'{"model": "fake"}', 400, "missing_field"),
    ("/v1/completions", b'{"model": "fake", "prompt": {"a": 1}}', 400, "invalid_type"),
    ("/v1/nope", b"{}", 404, "not_found"),
]


@pytest.mark.parametrize(("path", "raw", "status", "code"), CASES)
async def test_bad_bodies(proxy, http, path, raw, status, code):
    async with http.post(f"http://127.0.0.1:{proxy.port}{path}", data=raw,
                         headers={"Content-Type": "application/json"}) as r:
        assert r.status == status
        body = await r.json()
    assert shape_ok(body) and body["error"]["code"] == code


async def test_too_large_and_wrong_method(proxy, http):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 10000}]})
    async with http.post(f"http://127.0.0.1:{proxy.port}{CHAT}", data=big) as r:
        assert r.status == 413
        assert shape_ok(await r.json())
    async with http.get(f"http://127.0.0.1:{proxy.port}{CHAT}") as r:
        assert r.status == 405
        assert (await r.json())["error"]["code"] == "method_not_allowed"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids,
                                                              max_size=4),
    max_leaves=12)
known = st.fixed_dictionaries({}, optional={
    "model": json_values, "messages": json_values, "stream": json_values, "prompt": json_values,
    "max_tokens": json_values, "temperature": json_values, "stop": json_values,
    "tools": json_values, "stream_options": json_values, "fake": st.just({"status": 200}),
})
bodies = st.one_of(known.map(lambda d: json.dumps(d).encode()),
                   json_values.map(lambda v: json.dumps(v).encode()),
                   st.binary(max_size=64))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=bodies, path=st.sampled_from([CHAT, "/v1/completions"]))
async def test_random_bodies_never_5xx(proxy, http, raw, path):
    async with http.post(f"http://127.0.0.1:{proxy.port}{path}", data=raw,
                         headers={"Content-Type": "application/json"}) as r:
        assert r.status < 500, await r.text()
        await r.read()
    async with http.post(f"http://127.0.0.1:{proxy.port}{CHAT}",
                         json={"messages": [{"role": "user", "content": "still here"}]}) as r:
        assert r.status == 200


async def test_deep_nesting_and_bad_gzip_are_400(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)      # default body limit: deep nesting fits
    base = f"http://127.0.0.1:{proxy.port}{CHAT}"
    deep = ('{"messages":[{"role":"user","content":"hi"}],"x":' + "[" * 5000 + "]" * 5000
            + "}").encode()
    async with http.post(base, data=deep, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400 and shape_ok(await r.json())
    async with http.post(base, data=b"not gzip at all",
                         headers={"Content-Type": "application/json",
                                  "Content-Encoding": "gzip",
                                  "Connection": "close"}) as r:  # the stream is unusable after
        assert r.status == 400 and shape_ok(await r.json())
    async with http.post(base, json={"messages": [{"role": "user", "content": "ok"}]}) as r:
        assert r.status == 200
