"""Worker request handling on the in-process tiny qwen3 worker (issue 8/9 worker side): the
shared schema's limits, parameters the worker honours (log-probabilities, negative seeds) or
refuses by name, /tokenize without boundaries, the per-start token, a cache commit that fails
after the reply, and prompt rendering that stays bounded and stops when the client has left."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import KVCache
from worker_fixtures import HELLO, NAME, SETTINGS, chat, post, post_get, stream

from prefixd.backends.mlx.chat.prompt import Renderer
from prefixd.backends.mlx.chat.request import parse_request
from prefixd.backends.mlx.engine.stats import STAGES
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.server.app import create_app

LOGPROB_ATOL = 1e-4


async def test_negative_seed_means_no_seed(client: TestClient) -> None:
    for seed in (-1, -(2**63)):  # llama.cpp's "random"; was a 500
        out = await post(client, chat(max_tokens=3, temperature=1.0, seed=seed))
        assert out["usage"]["completion_tokens"] == 3


async def test_response_format_text_is_accepted(client: TestClient) -> None:
    out = await post(client, chat(max_tokens=2, response_format={"type": "text"}))
    assert out["choices"][0]["finish_reason"] == "length"


async def test_tokenize_without_boundaries(client: TestClient) -> None:
    messages = [*HELLO, {"role": "assistant", "content": "The river."},
                {"role": "user", "content": "And?"}]
    full = await post(client, {"messages": messages}, "/tokenize")
    bare = await post(client, {"messages": messages, "boundaries": False}, "/tokenize")
    assert bare == {"tokens": full["tokens"]} and full["boundaries"]
    resp = await client.post("/tokenize", json={"messages": messages, "boundaries": "no"})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "boundaries"


async def test_worker_token_guards_every_route_but_health(generator: Generator) -> None:
    app = create_app(generator, NAME, SETTINGS, token="s3cret")
    async with TestClient(TestServer(app)) as c:
        assert (await c.get("/health")).status == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                                 ("GET", "/v1/cache"), ("POST", "/v1/chat/completions"),
                                 ("POST", "/tokenize")):
                resp = await c.request(method, path, json=chat(max_tokens=1), headers=headers)
                assert resp.status == 401, (method, path, headers)
                err = (await resp.json())["error"]
                assert err["type"] == "authentication_error"
        good = {"Authorization": "Bearer s3cret"}
        assert (await c.get("/v1/models", headers=good)).status == 200
        resp = await c.post("/v1/chat/completions", json=chat(max_tokens=1), headers=good)
        assert resp.status == 200


async def test_a_failing_cache_commit_keeps_the_reply(client: TestClient,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    body = chat([{"role": "user", "content": "Commit test: the long river."}], max_tokens=5)
    cold = await post(client, body)
    before = (await post_get(client, "/v1/cache"))["fallbacks"].get("commit_error", 0)

    def broken(self: Any) -> int:
        raise RuntimeError("nbytes failed")

    # The outermost boundary: mlx-lm's cache class fails when the worker stores the entry.
    monkeypatch.setattr(KVCache, "nbytes", property(broken))
    out = await post(client, body)
    events = await stream(client, {**body, "stream_options": {"include_usage": True}})
    monkeypatch.undo()
    assert out["choices"] == cold["choices"]
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 5
    info = await post_get(client, "/v1/cache")
    assert info["fallbacks"]["commit_error"] - before == 2
    assert info["bytes_used"] == sum(e["bytes"] + e["checkpoint_bytes"] for e in info["entries"])


def _reference(generator: Generator, prompt: list[int], n: int) -> list[tuple[int, np.ndarray]]:
    """Greedy tokens and log-probabilities from stock mlx-lm's stream_generate."""
    loaded = generator.loaded
    assert loaded is not None
    out = []
    for r in stream_generate(loaded.model, loaded.tokenizer, mx.array(prompt), max_tokens=n,
                             sampler=lambda lp: mx.argmax(lp, axis=-1)):
        out.append((r.token, np.array(r.logprobs.astype(mx.float32))))
    return out


async def test_chat_logprobs_match_mlx_lm(client: TestClient, generator: Generator) -> None:
    body = chat(max_tokens=4, logprobs=True, top_logprobs=3)
    out = await post(client, body)
    prompt = (await post(client, {"messages": HELLO}, "/tokenize"))["tokens"]
    ref = _reference(generator, prompt, 4)
    tok = generator.loaded.tokenizer
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([t]) for t, _ in ref]
    assert "".join(c["token"] for c in content) == out["choices"][0]["message"]["content"]
    for item, (token, lp) in zip(content, ref, strict=True):
        assert math.isclose(item["logprob"], float(lp[token]), abs_tol=LOGPROB_ATOL)
        assert item["bytes"] == list(item["token"].encode())
        top = item["top_logprobs"]
        assert len(top) == 3 and top[0]["token"] == item["token"]  # greedy: the top one
        best = np.sort(lp)[::-1][:3]
        np.testing.assert_allclose([t["logprob"] for t in top], best, atol=LOGPROB_ATOL)
    events = await stream(client, body)
    streamed = [c for e in events[:-1] if e["choices"] and e["choices"][0]["logprobs"]
                for c in e["choices"][0]["logprobs"]["content"]]
    assert [c["token"] for c in streamed] == [c["token"] for c in content]
    np.testing.assert_allclose([c["logprob"] for c in streamed],
                               [c["logprob"] for c in content], atol=LOGPROB_ATOL)
    plain = await post(client, chat(max_tokens=2))
    assert plain["choices"][0]["logprobs"] is None


async def test_completion_logprobs_shape(client: TestClient) -> None:
    body = {"prompt": "The river and the sea", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    out = await post(client, body, "/v1/completions")
    (choice,) = out["choices"]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["tokens"]) == 4
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(4)]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                   strict=True):
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprob, abs=LOGPROB_ATOL)
        assert token in top and logprob <= 0
    events = await stream(client, body, "/v1/completions")
    chunks = [e["choices"][0]["logprobs"] for e in events[:-1] if e["choices"][0]["logprobs"]]
    assert [t for c in chunks for t in c["tokens"]] == lp["tokens"]
    assert [o for c in chunks for o in c["text_offset"]] == lp["text_offset"]


class CountingTokenizer:
    """The real tokenizer, counting chat-template renders and the messages they render (an
    observer of the real thing)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.renders, self.messages = tokenizer, 0, 0

    def apply_chat_template(self, messages: list[Any], *args: Any, **kwargs: Any) -> Any:
        self.renders += 1
        self.messages += len(messages)
        return self.tokenizer.apply_chat_template(messages, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def test_a_prompt_is_rendered_once_whatever_its_messages(generator: Generator) -> None:
    """Boundaries come from the one render of the prompt, so thousands of tiny messages (the
    schema allows 4096) cost one render of them, not one per message prefix."""
    counting = CountingTokenizer(generator.loaded.tokenizer)
    renderer = Renderer(counting)
    n = 1001
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"river {i}"}
                for i in range(n)]
    counting.renders = counting.messages = 0
    prompt = renderer.build(parse_request("chat", {"messages": messages}))
    assert (counting.renders, counting.messages) == (1, n)
    tok = generator.loaded.tokenizer
    assert len(prompt.boundaries) == n + 1  # every content start, and the last content end
    assert tok.decode(prompt.tokens[prompt.boundaries[0]:]).startswith("river 0<|im_end|>")
    assert tok.decode(prompt.tokens[prompt.boundaries[-2]:]).startswith(f"river {n - 1}")
    assert tok.decode(prompt.tokens[prompt.boundaries[-1]:]).startswith("<|im_end|>")


async def test_responses_carry_the_turn_breakdown(client: TestClient) -> None:
    body = chat([{"role": "user", "content": "Breakdown test: the river."}], max_tokens=3)
    first = await post(client, body)
    out = await post(client, body)  # warm
    for resp in (first, out):
        turn, usage = resp["prefixd"], resp["usage"]
        assert set(turn["timings_ms"]) == set(STAGES)
        assert all(v >= 0 for v in turn["timings_ms"].values())
        assert turn["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert turn["cached_tokens"] + turn["recomputed_tokens"] == usage["prompt_tokens"]
        assert sum(s["tokens"] for s in turn["prefill_segments"]) == turn["recomputed_tokens"]
        assert turn["checkpoints"] == {"count": 0, "bytes": 0}  # all-KV: nothing to snapshot
    assert out["prefixd"]["cached_tokens"] > 0
    events = await stream(client, {**body, "stream_options": {"include_usage": True}})
    assert events[-2]["prefixd"]["cached_tokens"] == events[-2]["usage"][
        "prompt_tokens_details"]["cached_tokens"]
    assert all("prefixd" not in e for e in events[:-2])
    plain = await stream(client, body)
    assert all("prefixd" not in e for e in plain[:-1])
    metrics = await (await client.get("/metrics")).text()
    assert 'prefixd_worker_stage_seconds_count{stage="prefill"}' in metrics
