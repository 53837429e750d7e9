"""Context windows known and enforced (issue 27 item 3): each backend's window (configured, a
llama-server's `/props`, a prefixd worker's `/v1/models`) shown in the proxy's `/v1/models`;
a prompt over it refused in each client API's own error shape before anything reaches the
upstream; `max_tokens` clamped to the room the prompt leaves, and the clamp reported; no
window known, nothing refused or clamped."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from fake_llama import FakeLlama
from fake_upstream import FakeUpstream
from proxy_fixtures import StartProxy

from prefixd.backends.managed import ManagedBackend
from prefixd.backends.supervision.states import ProcState
from prefixd.proxy.server import Server, make_proxy
from prefixd.proxy.settings import Settings
from prefixd.proxy.stages.window import Count, decide

TINY_WINDOW = 4096           # the tiny models' max_position_embeddings
WORDS = "word " * 4000       # 20,000 characters: over 1.25x a 1,000-token window at 4 a token


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": text}], **extra}


def anthropic(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake", "max_tokens": 32000,
            "messages": [{"role": "user", "content": text}], **extra}


REQUESTS: dict[str, tuple[str, Callable[[str], dict[str, Any]]]] = {
    "chat": ("/v1/chat/completions", chat),
    "completions": ("/v1/completions", lambda t: {"model": "fake", "prompt": t}),
    "messages": ("/v1/messages", anthropic),
    "responses": ("/v1/responses", lambda t: {"model": "fake", "input": t}),
}


def upstream_calls(up: FakeUpstream) -> list[str]:
    """The generation requests that reached the fake upstream (probes and tokenizer asks
    aside)."""
    return [p for p in up.paths if p in ("/v1/chat/completions", "/v1/completions")]


@pytest.mark.parametrize("api", list(REQUESTS))
async def test_an_over_window_prompt_gets_its_apis_error_before_the_upstream(
        api: str, upstream: FakeUpstream, start_proxy: StartProxy,
        http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy(upstream.url, backend={"context_window": 1000})
    path, body = REQUESTS[api]
    started = time.perf_counter()
    async with http.post(f"http://127.0.0.1:{proxy.port}{path}", json=body(WORDS)) as r:
        answer = await r.json()
        status = r.status
    elapsed_ms = (time.perf_counter() - started) * 1000
    print(f"refused {api} in {elapsed_ms:.1f} ms")     # recorded, not asserted
    assert status == 400, answer
    if api == "messages":
        assert answer["type"] == "error"
        assert answer["error"]["type"] == "invalid_request_error"
        message = answer["error"]["message"]
    else:
        assert answer["error"]["code"] == "context_length_exceeded"
        message = answer["error"]["message"]
    # Claude Code reads this sentence (Anthropic's own wording): N tokens > M maximum, M the
    # window as /v1/models states it (not one less); the param is the client's own field
    assert message.startswith("prompt is too long: ") and "tokens > 1000 maximum" in message
    if api != "messages":
        assert answer["error"]["param"] == {"responses": "input", "completions": "prompt"}.get(
            api, "messages")
    assert "an estimate" in message                    # this upstream cannot tokenize
    assert upstream.received == [] and upstream_calls(upstream) == []


async def test_max_tokens_is_clamped_to_the_room_left_and_reported(
        upstream: FakeUpstream, start_proxy: StartProxy, http: aiohttp.ClientSession,
        caplog: pytest.LogCaptureFixture) -> None:
    proxy = await start_proxy(upstream.url, backend={"context_window": 8192})
    base = f"http://127.0.0.1:{proxy.port}"
    text = "Say hello. " * 200     # 2,200 characters: ~600 tokens; 440 by the low estimate
    with caplog.at_level(logging.INFO, logger="prefixd.request"):
        async with http.post(base + "/v1/chat/completions",
                             json=chat(text, max_tokens=128000)) as r:
            assert r.status == 200, await r.text()
            header = r.headers["X-Prefixd-Max-Tokens"]
    sent = upstream.received[-1]["max_tokens"]
    assert header == f"clamped from 128000 to {sent} (window 8192)"
    # the low estimate (rendered characters / 5) never shortens an answer that would fit
    assert 8192 - 450 <= sent <= 8192 - 440
    assert f"max_tokens=128000->{sent}" in caplog.text
    # the translated APIs' limits are clamped too (Claude Code asks for 32000)
    async with http.post(base + "/v1/messages", json=anthropic(text)) as r:
        assert r.status == 200 and "X-Prefixd-Max-Tokens" in r.headers
    assert upstream.received[-1]["max_tokens"] == sent
    # max_completion_tokens, and a limit that fits, which is left alone
    async with http.post(base + "/v1/chat/completions",
                         json=chat(text, max_completion_tokens=50000)) as r:
        assert r.status == 200 and "X-Prefixd-Max-Tokens" in r.headers
    assert upstream.received[-1]["max_completion_tokens"] == sent
    async with http.post(base + "/v1/chat/completions", json=chat(text, max_tokens=100)) as r:
        assert r.status == 200 and "X-Prefixd-Max-Tokens" not in r.headers
    assert upstream.received[-1]["max_tokens"] == 100


async def test_no_window_known_refuses_and_clamps_nothing(
        upstream: FakeUpstream, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy(upstream.url)
    body = chat(WORDS * 10, max_tokens=128000)
    async with http.post(f"http://127.0.0.1:{proxy.port}/v1/chat/completions", json=body) as r:
        assert r.status == 200 and "X-Prefixd-Max-Tokens" not in r.headers
    assert upstream.received[-1]["max_tokens"] == 128000
    async with http.get(f"http://127.0.0.1:{proxy.port}/v1/models") as r:
        assert "context_length" not in (await r.json())["data"][0]


async def test_a_llama_servers_window_is_its_slot_context(
        start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    llama = FakeLlama(n_ctx=2048)
    await llama.start()
    try:
        proxy = await start_proxy(llama.url)
        base = f"http://127.0.0.1:{proxy.port}"
        async with http.get(base + "/v1/models") as r:
            assert (await r.json())["data"][0]["context_length"] == 2048
        async with http.post(base + "/v1/chat/completions", json=chat(WORDS * 3)) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "context_length_exceeded"
        assert llama.received == []
        configured = await start_proxy(llama.url, backend={"context_window": 1024})
        async with http.get(f"http://127.0.0.1:{configured.port}/v1/models") as r:
            assert (await r.json())["data"][0]["context_length"] == 1024    # the setting wins
    finally:
        await llama.stop()


async def test_a_workers_window_and_exact_count(
        client: TestClient, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    """The in-process worker (tiny qwen3) as a `prefixd` backend: its window from its model,
    the prompt counted by its tokenizer, so a prompt under the estimate's threshold but over
    the window is refused with its exact count."""
    async with client.get("/v1/models") as r:
        assert (await r.json())["data"][0]["context_length"] == TINY_WINDOW
    proxy = await start_proxy(backends=[{"name": "w", "kind": "prefixd", "models": ["fake"],
                                         "url": str(client.make_url("")).rstrip("/")}])
    base = f"http://127.0.0.1:{proxy.port}"
    async with http.get(base + "/v1/models") as r:
        assert (await r.json())["data"][0]["context_length"] == TINY_WINDOW
    dense = "x " * 6000        # ~1 token per 2 characters: 2,400 by the estimate, 6,000 real
    async with client.post("/tokenize", json={**chat(dense), "boundaries": False}) as r:
        exact = len((await r.json())["tokens"])
    assert exact > TINY_WINDOW > len(dense) // 5
    started = time.perf_counter()
    async with http.post(base + "/v1/messages", json=anthropic(dense)) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    print(f"refused with an exact count in {(time.perf_counter() - started) * 1000:.1f} ms")
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(
        f"prompt is too long: {exact} tokens > {TINY_WINDOW} maximum (backend w")
    short = "Tell me about the river."
    async with client.post("/tokenize", json={**chat(short), "boundaries": False}) as r:
        n = len((await r.json())["tokens"])
    async with http.post(base + "/v1/chat/completions",
                         json=chat(short, max_tokens=128000, temperature=0)) as r:
        assert r.status == 200, await r.text()
        assert r.headers["X-Prefixd-Max-Tokens"] == (
            f"clamped from 128000 to {TINY_WINDOW - n} (window {TINY_WINDOW})")


async def test_a_managed_workers_window(tiny_model_dir: Callable[[str], Path],
                                        http: aiohttp.ClientSession) -> None:
    settings = Settings(_env_file=None, backends=[
        {"name": "tiny", "kind": "mlx", "model": str(tiny_model_dir("qwen3")),
         "models": ["tiny"]}])
    managed = ManagedBackend(settings.backends[0], settings)
    # not loaded yet: its model's config says (issue 33: `prefixd launch` right after
    # `prefixd serve` found no window while the weights loaded, and Claude Code assumed 1M)
    assert await managed.context_window() == TINY_WINDOW
    server = Server(make_proxy(settings, [managed]))
    await server.start("127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with http.get(base + "/v1/models") as r:
            (entry,) = (await r.json())["data"]
        assert entry["state"] != "loaded" and entry["context_length"] == TINY_WINDOW
        await managed.wait_for(ProcState.READY, timeout=120)
        async with http.get(base + "/v1/models") as r:
            assert (await r.json())["data"][0]["context_length"] == TINY_WINDOW
        body = {**anthropic("x " * 6000), "model": "tiny"}
        started = time.perf_counter()
        async with http.post(base + "/v1/messages", json=body) as r:
            assert r.status == 400
            message = (await r.json())["error"]["message"]
        print(f"managed: refused in {(time.perf_counter() - started) * 1000:.1f} ms")
        assert message.startswith("prompt is too long: ")
        assert f"> {TINY_WINDOW} maximum" in message and "estimate" not in message
    finally:
        await server.shutdown(1.0)


def test_the_decision_at_the_edge() -> None:
    assert decide(Count(4095, True), 4096, 10, "b", "messages").sent == 1   # type: ignore[union-attr]
    assert decide(Count(100, True), 4096, None, "b", "messages") is None   # no limit asked
    assert decide(Count(100, False), 4096, 3996, "b", "messages") is None  # exactly the room
    with pytest.raises(Exception, match="prompt is too long: 4096 tokens = 4096 maximum, no "
                       "room left to answer"):
        decide(Count(4096, True), 4096, None, "b", "messages")
    with pytest.raises(Exception, match="prompt is too long: 4097 tokens > 4096 maximum"):
        decide(Count(4097, True), 4096, None, "b", "messages")


async def test_overlapping_probes_keep_the_working_probe_path(upstream: FakeUpstream) -> None:
    """The window's first probe may overlap the probe loop's: an upstream without /health
    (this one) must still be probed on /v1/models afterwards, not on no path at all."""
    from prefixd.backends.config import BackendConfig
    from prefixd.backends.openai import OpenAIBackend

    backend = OpenAIBackend(BackendConfig(name="up", url=upstream.url, models=["fake"]))
    try:
        assert all(await asyncio.gather(*(backend.probe_once() for _ in range(3))))
        assert await backend.probe_once()
    finally:
        await backend.stop()
