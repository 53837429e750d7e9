"""Property-based fuzzing: random client bodies on every client API, and random upstream
event streams, never give a 5xx caused by the client, a hang, or a broken response; random
bodies against a real worker never give a 5xx.

Bounded for CI (PREFIXD_FUZZ_EXAMPLES, default 60 per test). The long run behind
`PREFIXD_FUZZ_EXAMPLES=2000` is recorded in docs/RELIABILITY.md.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.worker_fixtures import loaded

EXAMPLES = int(os.environ.get("PREFIXD_FUZZ_EXAMPLES", "60"))
REPORT = os.environ.get("PREFIXD_FUZZ_REPORT")     # a file: statuses and RSS are written there
STATUSES: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def ledger() -> Iterator[None]:
    """Requests by test and status, and this process's RSS before and after (the long run
    in docs/RELIABILITY.md)."""
    proc = psutil.Process()
    before = proc.memory_info().rss
    yield
    if REPORT:
        after = proc.memory_info().rss
        with open(REPORT, "w") as f:
            json.dump({"examples_per_test": EXAMPLES, "statuses": dict(STATUSES),
                       "rss_mib_before": round(before / 2**20, 1),
                       "rss_mib_after": round(after / 2**20, 1)}, f, indent=1)
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
APIS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
        "/v1/messages/count_tokens"]

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
           | st.text(max_size=12) | st.sampled_from(["user", "assistant", "tool", "system",
                                                       "text", "tool_use", "function_call"]))
values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                      | st.dictionaries(st.text(max_size=10), kids, max_size=4), max_leaves=16)
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result",
                                                        "image", "input_text", "thinking"])},
                             optional={"text": values, "id": values, "input": values,
                                       "content": values, "tool_use_id": values})
message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "assistant", "tool", "system", "developer", "x"]) | values,
    "content": st.text(max_size=30) | st.lists(part, max_size=3) | values,
    "tool_calls": values, "tool_call_id": values, "type": values, "name": values})
body = st.fixed_dictionaries({}, optional={
    "model": st.just("fake") | values, "messages": st.lists(message, max_size=4) | values,
    "input": st.lists(message, max_size=3) | values, "prompt": values, "system": values,
    "instructions": values, "stream": st.booleans() | values, "max_tokens": values,
    "max_output_tokens": values, "temperature": values, "tools": values,
    "tool_choice": values, "stop": values, "seed": values, "stream_options": values,
    "previous_response_id": values, "thinking": values})
# A valid request with one known field set to anything: reaches past validation often.
KNOWN = ["temperature", "top_p", "top_k", "seed", "stop", "max_tokens", "stream",
         "stream_options", "tools", "tool_choice", "logprobs", "top_logprobs", "n", "user",
         "response_format", "logit_bias", "chat_template_kwargs", "presence_penalty"]
near_valid = st.builds(
    lambda text, key, value, stream: {"model": "fake", "max_tokens": 2, "stream": stream,
                                      "messages": [{"role": "user", "content": text}],
                                      "prompt": text or "x", "input": text or "x",
                                      key: value},
    st.text(min_size=1, max_size=40), st.sampled_from(KNOWN), values, st.booleans())
raw_bodies = st.one_of(near_valid.map(lambda d: json.dumps(d).encode()),
                       body.map(lambda d: json.dumps(d).encode()),
                       values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=48))


@pytest.fixture
async def proxy(upstream, start_proxy):
    return await start_proxy(upstream.url, max_body_bytes=65536)


@FUZZ
@given(raw=raw_bodies, path=st.sampled_from(APIS))
async def test_random_client_bodies_never_5xx(proxy, http, raw, path):
    base = f"http://127.0.0.1:{proxy.port}"
    async with http.post(base + path, data=raw,
                         headers={"Content-Type": "application/json"}) as r:
        data = await asyncio.wait_for(r.read(), 20)
        STATUSES[f"client {path} {r.status}"] += 1
        assert r.status < 500, data[:300]
    assert b"HTTP/1.1" not in data


chunk_values = st.fixed_dictionaries({}, optional={
    "choices": st.lists(st.fixed_dictionaries({}, optional={
        "index": values, "finish_reason": values | st.sampled_from(["stop", "tool_calls"]),
        "delta": st.fixed_dictionaries({}, optional={
            "content": st.text(max_size=8) | values, "reasoning_content": values,
            "tool_calls": st.lists(st.fixed_dictionaries({}, optional={
                "index": values | st.integers(0, 3), "id": values,
                "function": st.fixed_dictionaries({}, optional={
                    "name": values, "arguments": st.text(max_size=8) | values}) | values}),
                max_size=2) | values}) | values}), max_size=2) | values,
    "usage": st.fixed_dictionaries({}, optional={
        "prompt_tokens": values, "completion_tokens": values,
        "prompt_tokens_details": values}) | values})
events = st.lists(st.one_of(
    chunk_values.map(lambda c: "data: " + json.dumps(c) + "\n\n"),
    values.map(lambda v: "data: " + json.dumps(v) + "\n\n"),
    st.text(max_size=30).map(lambda t: t + "\n\n"),
    st.sampled_from(["data: [DONE]\n\n", ": comment\n\n", "data: {\r\n\r\n", "\r\n"])),
    max_size=8)


@FUZZ
@given(raw=events, path=st.sampled_from(["/v1/chat/completions", "/v1/messages",
                                         "/v1/responses"]), stream=st.booleans())
async def test_random_upstream_streams_never_break_the_answer(proxy, http, raw, path, stream):
    """Whatever the upstream streams, the client gets a whole response (a stream that ends,
    or a JSON body) or a clean 502, within the deadline."""
    base = f"http://127.0.0.1:{proxy.port}"
    msgs = [{"role": "user", "content": "hi"}]
    req = {"model": "fake", "stream": stream, "max_tokens": 5, "fake": {"raw": raw},
           "messages": msgs} if path != "/v1/responses" else {
        "model": "fake", "stream": stream, "input": "hi", "fake": {"raw": raw}}
    async with http.post(base + path, json=req) as r:
        data = await asyncio.wait_for(r.read(), 20)
        STATUSES[f"upstream {path} {r.status}"] += 1
        assert r.status in (200, 502), data[:300]
    assert b"HTTP/1.1" not in data


# --- the worker ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def generator(tiny_model_dir: Callable[[str], Path]) -> Iterator[object]:
    from prefixd.backends.mlx.scheduler.generator import Generator
    from prefixd.backends.mlx.settings import WorkerSettings

    gen = Generator(WorkerSettings(_env_file=None, max_tokens_default=2,
                                   use_system_blas=False))
    loaded(gen, str(tiny_model_dir("qwen3")))
    yield gen
    gen.close()


@pytest.fixture
async def worker(generator) -> AsyncIterator[object]:
    from aiohttp.test_utils import TestClient, TestServer

    from prefixd.backends.mlx.server.app import create_app

    async with TestClient(TestServer(create_app(generator, "tiny", generator.settings))) as c:
        yield c


@FUZZ
@given(raw=raw_bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions",
                                             "/tokenize"]))
async def test_random_bodies_against_the_worker_never_5xx(worker, raw, path):
    resp = await worker.post(path, data=raw, headers={"Content-Type": "application/json"})
    data = await asyncio.wait_for(resp.read(), 60)
    STATUSES[f"worker {path} {resp.status}"] += 1
    assert resp.status < 500, data[:300]
