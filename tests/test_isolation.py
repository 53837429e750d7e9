"""Per-key cache isolation (issue 25 item 6, `PREFIXD_CACHE_ISOLATION=per_key`): prompt-cache
entries, conversations (lanes) and routing predictions are shared only between requests made
with the same API key. The known prefix-cache side channel — `cached_tokens` telling a client
whether a prefix it guessed (another client's system prompt) is cached — is closed for
prefixd workers; the default stays one shared cache (a single-user daemon).

The worker's partitions are checked on the in-process worker (its real app), the whole path
through the proxy on a managed worker process."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from worker_fixtures import chat

from prefixd.api.schema import NAMESPACE_HEADER
from prefixd.backends.managed import ManagedBackend
from prefixd.backends.supervision.states import ProcState
from prefixd.proxy.keys import cache_namespace
from prefixd.proxy.server import Server, make_proxy
from prefixd.proxy.settings import Settings

SECRET = [{"role": "system", "content": "The launch code is 7-4-1-9. Never tell anyone. " * 6},
          {"role": "user", "content": "What is the weather like today?"}]


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def ask(client: TestClient, namespace: str | None, messages: list[dict]) -> dict:
    headers = {NAMESPACE_HEADER: namespace} if namespace is not None else {}
    resp = await client.post("/v1/chat/completions", json=chat(messages, max_tokens=3),
                             headers=headers)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_a_partition_never_restores_another_ones_prefix(client: TestClient) -> None:
    victim = SECRET
    guess = [victim[0], {"role": "user", "content": "Hello there, who are you?"}]
    first = await ask(client, "aa11", victim)
    assert cached(first) == 0
    # another key guesses the victim's system prompt: nothing of it is cached for them
    probe = await ask(client, "bb22", guess)
    assert cached(probe) == 0
    # the shared partition (no header) does not see it either
    assert cached(await ask(client, None, guess)) == 0
    # ... while the victim's own next turn reuses its prefix
    again = await ask(client, "aa11", guess)
    assert cached(again) > 20


async def test_same_partition_shares_and_answers_equal_the_shared_cache(client: TestClient
                                                                          ) -> None:
    messages = [{"role": "system", "content": "Be terse. " * 30},
                {"role": "user", "content": "Name a colour."}]
    cold = await ask(client, "cc33", messages)
    warm = await ask(client, "cc33", messages)
    assert cached(warm) > 0
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]


@pytest.mark.parametrize("bad", ["XYZ", "a" * 65, "ab cd", "-1"])
async def test_a_malformed_namespace_is_a_400(client: TestClient, bad: str) -> None:
    resp = await client.post("/v1/chat/completions", json=chat(max_tokens=2),
                             headers={NAMESPACE_HEADER: bad})
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "invalid_namespace"


def test_a_namespace_stands_for_the_key_and_hides_it() -> None:
    a = cache_namespace({"Authorization": "Bearer key-a"}, "per_key")
    assert a == cache_namespace({"x-api-key": "key-a"}, "per_key")
    assert a != cache_namespace({"Authorization": "Bearer key-b"}, "per_key")
    assert "key-a" not in a and len(a) == 24
    assert cache_namespace({"Authorization": "Bearer key-a"}, "shared") == ""


async def turn(http: aiohttp.ClientSession, url: str, key: str,
               messages: list[dict]) -> tuple[dict, str]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0}
    async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200
        return json.loads(await r.read()), r.headers.get("X-Prefixd-Prefix", "")


@pytest.mark.slow
async def test_through_the_proxy_another_key_learns_nothing(
        tiny_model_dir: Callable[[str], Path], http: aiohttp.ClientSession) -> None:
    """Two clients of one prefixd with different keys and the same system prompt: the second
    gets no cached tokens and no prefix report from the first's conversation; each key's own
    next turn is warm. With the default (shared), the same probe is a hit: the side channel."""
    model = tiny_model_dir("qwen3")
    for isolation, probe_hit in (("per_key", False), ("shared", True)):
        settings = Settings(_env_file=None, cache_isolation=isolation, backends=[
            {"name": "w", "kind": "mlx", "model": str(model), "models": ["tiny"]}])
        backend = ManagedBackend(settings.backends[0], settings)
        server = Server(make_proxy(settings, [backend]))
        await server.start("127.0.0.1", 0)
        try:
            await backend.wait_for(ProcState.READY, timeout=120)
            url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
            await turn(http, url, "key-victim", SECRET)
            guess = [SECRET[0], {"role": "user", "content": "Hello there, who are you?"}]
            probe, report = await turn(http, url, "key-probe", guess)
            assert (cached(probe) > 20) is probe_hit, (isolation, probe["usage"])
            if not probe_hit:
                assert report.startswith("verdict=NEW"), report   # not the victim's lane
            own, _ = await turn(http, url, "key-victim", SECRET)
            assert cached(own) > 20
        finally:
            await server.shutdown(5.0)
