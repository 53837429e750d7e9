"""Truth from the backend (issue 17 item 2), end to end: the proxy in front of a real worker on
a tiny hybrid model (Gated-DeltaNet: recurrent state restores only at checkpoints) predicts the
cached tokens the worker then reports, because each response says which prefixes of its tokens
the worker can restore (`prefixd.restorable`); a pure-KV model restores any prefix."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from fake_upstream import FakeUpstream
from worker_fixtures import chat, post

from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.server.app import create_app
from prefixd.proxy.prefix.segments import flatten
from prefixd.proxy.routing.index import boundaries
from prefixd.proxy.server import Server
from prefixd.proxy.settings import Settings
from tests.worker_fixtures import loaded

# In-message checkpoints every 128 tokens after each message start (set, not sized to the model,
# so the branch below lands between two of them).
SETTINGS = Settings(_env_file=None, max_tokens_default=5, use_system_blas=False,
                    checkpoint_interval=128)
SYSTEM = "You are a cache agent. Keep the state of every request. " * 4


@pytest.fixture(scope="module")
def hybrid(tiny_model_dir: Callable[[str], Path]) -> Iterator[tuple[Generator, Path]]:
    model = tiny_model_dir("qwen3_next")
    gen = Generator(SETTINGS)
    loaded(gen, str(model))
    yield gen, model
    gen.close()


@pytest.fixture
async def proxy(hybrid: tuple[Generator, Path], start_proxy: Any) -> AsyncIterator[str]:
    """The proxy's chat URL, in front of the hybrid worker (a `prefixd` backend)."""
    worker = TestServer(create_app(hybrid[0], "tiny", SETTINGS), host="127.0.0.1")
    await worker.start_server()
    try:
        server: Server = await start_proxy(backends=[{
            "name": "w", "kind": "prefixd", "url": f"http://127.0.0.1:{worker.port}",
            "models": ["tiny"]}])
        yield f"http://127.0.0.1:{server.port}/v1/chat/completions"
    finally:
        await worker.close()


async def _ask(http: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]]
               ) -> tuple[int, dict[str, Any]]:
    """(the proxy's predicted cached tokens, the worker's answer as the client got it)."""
    async with http.post(url, json={"model": "tiny", "temperature": 0,
                                    "messages": messages}) as r:
        assert r.status == 200, await r.text()
        header = r.headers["X-Prefixd-Prefix"]
        return int(header.split("predicted=")[1].split(";")[0]), await r.json()


def _cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def _content_span(model: Path, messages: list[dict[str, Any]]) -> tuple[int, int]:
    """Token positions where the last message's content starts and ends in the prompt, by the
    model's own tokenizer and template (the worker's message boundaries)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    content = messages[-1]["content"]
    at = text.rindex(content)
    return (len(tok.encode(text[:at], add_special_tokens=False)),
            len(tok.encode(text[:at + len(content)], add_special_tokens=False)))


async def test_turn_two_predicts_what_the_hybrid_worker_restores(
        hybrid: tuple[Generator, Path], proxy: str, http: aiohttp.ClientSession) -> None:
    turn1 = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Tell me about the river and the sea. " * 12}]
    _, first = await _ask(http, proxy, turn1)
    digest = first["prefixd"]["restorable"]
    assert digest["any_prefix"] is False and digest["prefix_to"] == 0
    # checkpoints at turn 1's message boundaries (the user message's content start and end),
    # its prompt end, and the stored end (prompt + reply)
    start, end = _content_span(hybrid[1], turn1)
    usage = first["usage"]
    stored = usage["prompt_tokens"] + usage["completion_tokens"]
    assert {start, end, usage["prompt_tokens"], stored} <= set(digest["positions"])
    assert digest["positions"] == sorted(digest["positions"]) and digest["positions"][-1] == stored

    reply = first["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": reply},
             {"role": "user", "content": "And the city?"}]
    predicted, second = await _ask(http, proxy, turn2)
    assert _cached(second) > usage["prompt_tokens"]      # the reply was restored too
    assert predicted == _cached(second)


async def test_a_branch_inside_a_message_predicts_the_checkpoint_below_it(
        proxy: str, http: aiohttp.ClientSession) -> None:
    """A client that sends a message as several text parts and changes the last one (an agent
    editing a reminder block, say): the proxy's deepest shared boundary is after the first
    part, where a pure-KV model would restore; the hybrid worker restores only at its last
    in-message checkpoint before it, and that is what the proxy now predicts."""
    notes = "The model keeps a window of the state for every layer. " * 20   # ~200 tokens
    original = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [
        {"type": "text", "text": notes},
        {"type": "text", "text": "Now write the first part of the reply. " * 10}]}]
    edited = [original[0], {"role": "user", "content": [
        {"type": "text", "text": notes},
        {"type": "text", "text": "Then go home and read a story to the children. " * 10}]}]
    await _ask(http, proxy, original)
    predicted, answer = await _ask(http, proxy, edited)
    assert 0 < _cached(answer) < answer["usage"]["prompt_tokens"]
    assert predicted == _cached(answer)


async def test_a_pure_kv_worker_restores_any_prefix(client: TestClient) -> None:
    out = await post(client, chat(max_tokens=4))
    stored = out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]
    assert out["prefixd"]["restorable"] == {"positions": [stored], "prefix_to": stored,
                                            "any_prefix": True, "boundaries": []}


def _answer(digest: object) -> dict[str, Any]:
    """A fake upstream's scripted answer: 300 prompt tokens, none cached, and `digest` as a
    prefixd worker's `restorable`."""
    body = {"id": "c1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 300, "completion_tokens": 1, "total_tokens": 301,
                      "prompt_tokens_details": {"cached_tokens": 0}},
            "prefixd": {"restorable": digest}}
    return {"raw": [json.dumps(body)], "content_type": "application/json"}


@pytest.mark.parametrize(("digest", "whole", "system_only"), [
    # only the prompt's end (and the reply's) restores: the shared system prompt does not
    ({"positions": [300, 301], "prefix_to": 0, "any_prefix": False}, 301, 0),
    # any prefix restores, or no usable digest: every boundary counts, as for any backend
    ({"positions": [301], "prefix_to": 301, "any_prefix": True}, 300, None),
    ({"positions": ["x", 300]}, 300, None),
    ({"positions": [300], "prefix_to": -1}, 300, None),
    ({"positions": list(range(5000))}, 300, None),
    ({"positions": 300}, 300, None),
    ("all of it", 300, None),
])
async def test_the_index_reads_a_backends_digest(upstream: FakeUpstream, start_proxy: Any,
                                                 http: aiohttp.ClientSession, digest: object,
                                                 whole: int, system_only: int | None) -> None:
    """`system_only` None: the shared system prompt counts (some tokens, estimated)."""
    server = await start_proxy(upstream.url)
    body = {"model": "fake", "messages": [{"role": "system", "content": "sys " * 100},
                                          {"role": "user", "content": "first question " * 20}]}
    upstream.scripted.append(_answer(digest))
    async with http.post(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                         json=body) as r:
        assert r.status == 200
    index = server.proxy.router.prefixes
    assert index.longest(boundaries(flatten(body)), now=0.0)["up"] == (whole, True)
    other = {**body, "messages": [body["messages"][0], {"role": "user", "content": "else"}]}
    shared, own = index.longest(boundaries(flatten(other)), now=0.0)["up"]
    assert not own and (shared == system_only if system_only is not None else shared > 0)
