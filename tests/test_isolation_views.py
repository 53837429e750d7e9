"""Isolation on every operator view (issue 33 item 4), through a real proxy on loopback in
front of a fake upstream: under `PREFIXD_CACHE_ISOLATION=per_key` a key sees only its own
lanes on /debug/prefix and /status (the status page reads nothing else), another key's lane is
a 404 however its id is spelled, /metrics is the operator key's; lane ids are keyed, so the
id of a guessed first message confirms nothing; under `shared` nothing changes."""

from __future__ import annotations

import hashlib
from typing import Any
from urllib.parse import quote

import aiohttp

from prefixd.proxy.keys import cache_namespace

OPERATOR = "operator-key-0123456789"
A, B = "key-alice", "key-bob"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(first: str, system: str = "You are a helpful assistant.") -> dict:
    return {"model": "fake", "messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": first}]}


async def ask(http: aiohttp.ClientSession, proxy: Any, key: str, first: str) -> None:
    async with http.post(f"http://127.0.0.1:{proxy.port}/v1/chat/completions",
                         json=chat(first), headers=auth(key)) as r:
        assert r.status == 200, await r.text()


async def get(http: aiohttp.ClientSession, proxy: Any, path: str, key: str
              ) -> tuple[int, Any]:
    async with http.get(f"http://127.0.0.1:{proxy.port}{path}", headers=auth(key)) as r:
        body = await r.read()
        return r.status, (await r.json() if r.content_type == "application/json" else body)


async def lanes(http: aiohttp.ClientSession, proxy: Any, key: str) -> set[str]:
    status, body = await get(http, proxy, "/debug/prefix", key)
    assert status == 200, body
    return {x["lane"] for x in body["lanes"]}


def scope(key: str) -> str:
    """The start of every lane id of `key` (its namespace's first digits)."""
    return cache_namespace(auth(key), "per_key")[:8]


async def two_keys(http: aiohttp.ClientSession, start_proxy: Any, url: str,
                   **settings: Any) -> Any:
    proxy = await start_proxy(url, cache_isolation="per_key", **settings)
    await ask(http, proxy, A, "Alice's secret plan for the merger")
    await ask(http, proxy, B, "Bob's question about the weather")
    return proxy


async def test_debug_prefix_lists_only_the_callers_own_lanes(upstream, start_proxy, http):
    proxy = await two_keys(http, start_proxy, upstream.url, operator_key=OPERATOR)
    mine, theirs = await lanes(http, proxy, A), await lanes(http, proxy, B)
    assert len(mine) == 1 and all(lane.startswith(scope(A)) for lane in mine)
    assert len(theirs) == 1 and all(lane.startswith(scope(B)) for lane in theirs)
    assert await lanes(http, proxy, OPERATOR) == mine | theirs
    # a key that made no request sees no lane at all
    assert await lanes(http, proxy, "key-eve") == set()


async def test_another_keys_lane_is_a_404_however_spelled(upstream, start_proxy, http):
    proxy = await two_keys(http, start_proxy, upstream.url, operator_key=OPERATOR)
    (alice,) = await lanes(http, proxy, A)
    for spelled in (quote(alice, safe=""), quote(alice, safe="/:"), alice.replace("/", "%2f")):
        path = f"/debug/prefix/{spelled}"
        status, body = await get(http, proxy, path, B)
        assert status == 404 and body["error"]["code"] == "lane_not_found", (spelled, body)
        missing = await get(http, proxy, "/debug/prefix/" + quote(scope(B) + "/fp:0", safe=""),
                            B)
        assert body["error"]["message"].replace(alice, "X") == \
            missing[1]["error"]["message"].replace(scope(B) + "/fp:0", "X")   # same answer
    status, body = await get(http, proxy, "/debug/prefix/" + quote(alice, safe=""), A)
    assert status == 200 and body["reports"]
    status, _ = await get(http, proxy, "/debug/prefix/" + quote(alice, safe=""), OPERATOR)
    assert status == 200


async def test_status_shows_only_the_callers_conversations(upstream, start_proxy, http):
    proxy = await two_keys(http, start_proxy, upstream.url, operator_key=OPERATOR)

    async def conversations(key: str) -> tuple[set[str], int]:
        status, body = await get(http, proxy, "/status", key)
        assert status == 200
        index = body["backends"][0]["index"]
        return {c["lane"] for c in index["top"]}, index["conversations"]

    mine, n = await conversations(A)
    assert n == 1 and mine == await lanes(http, proxy, A)
    theirs, _ = await conversations(B)
    assert theirs == await lanes(http, proxy, B) and not mine & theirs
    everyone, n = await conversations(OPERATOR)
    assert n == 2 and everyone == mine | theirs


async def test_metrics_are_the_operators_under_per_key(upstream, start_proxy, http):
    proxy = await two_keys(http, start_proxy, upstream.url, operator_key=OPERATOR)
    status, body = await get(http, proxy, "/metrics", A)
    assert status == 403 and body["error"]["code"] == "operator_only"
    status, text = await get(http, proxy, "/metrics", OPERATOR)
    assert status == 200
    for key in (A, B):         # no label names a key's namespace or lane
        assert cache_namespace(auth(key), "per_key")[:8].encode() not in text
    assert b"fp:" not in text
    # without an operator key configured, no one reads them
    bare = await two_keys(http, start_proxy, upstream.url)
    assert (await get(http, bare, "/metrics", A))[0] == 403


async def test_the_operator_key_passes_the_api_key_check(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url, cache_isolation="per_key", api_key="the-api-key",
                              operator_key=OPERATOR)
    await ask(http, proxy, "the-api-key", "hello")
    assert len(await lanes(http, proxy, OPERATOR)) == 1
    assert (await get(http, proxy, "/metrics", OPERATOR))[0] == 200
    assert (await get(http, proxy, "/debug/prefix", "wrong"))[0] == 401


def _unkeyed(first: str) -> str:
    """The lane digest before issue 33: sha1 of client, model and first message, no key."""
    h = hashlib.sha1()
    for p in ("other", "fake", first):
        h.update(p.encode())
        h.update(b"\x00")
    return h.hexdigest()[:12]


async def test_lane_ids_are_keyed_so_a_guess_confirms_nothing(upstream, start_proxy, http):
    """The same first message: under two keys two unrelated digests, neither the unkeyed one;
    in two runs (random secrets) two digests; with one configured secret, replicas agree."""
    first = "Alice's secret plan for the merger"
    proxy = await start_proxy(upstream.url, cache_isolation="per_key", operator_key=OPERATOR)
    await ask(http, proxy, A, first)
    await ask(http, proxy, B, first)
    every = await lanes(http, proxy, OPERATOR)
    (a,), (b,) = ([x for x in every if x.startswith(scope(k))] for k in (A, B))
    da, db = a.split("/", 1)[1], b.split("/", 1)[1]
    assert da.startswith("fp:") and db.startswith("fp:") and da != db
    assert _unkeyed(first) not in (da[3:], db[3:])
    again = await start_proxy(upstream.url, cache_isolation="per_key", operator_key=OPERATOR)
    await ask(http, again, A, first)
    assert await lanes(http, again, OPERATOR) != {a}
    replicas = [await start_proxy(upstream.url, cache_isolation="per_key",
                                  lane_secret="one-secret-for-both-replicas") for _ in range(2)]
    for r in replicas:
        await ask(http, r, A, first)
    assert await lanes(http, replicas[0], A) == await lanes(http, replicas[1], A) != set()


async def test_shared_isolation_shows_everything_to_every_caller(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)
    await ask(http, proxy, A, "one")
    await ask(http, proxy, B, "two")
    assert len(await lanes(http, proxy, A)) == 2
    assert (await get(http, proxy, "/metrics", A))[0] == 200
