"""Cache-affinity routing (issue 17): the prefix index, the pure decision table, rendezvous
spreading that two proxies agree on without sharing state, and the whole thing in front of
three upstreams with conversations that send no session id."""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import Any

import pytest
from fake_upstream import FakeUpstream

from prefixd.backends.registry import build_backends
from prefixd.proxy.prefix.segments import flatten
from prefixd.proxy.routing.index import PrefixIndex, boundaries
from prefixd.proxy.routing.policy import Balance, Candidate, decide, rendezvous, transfer_source
from prefixd.proxy.server import make_proxy
from prefixd.proxy.settings import Settings


def C(name: str, load: int = 0, cached: int = 0, up: bool = True, slots: int = 1) -> Candidate:
    return Candidate(name, up, load, slots, cached, cached)


@pytest.mark.parametrize(("cands", "affinity", "want"), [
    # the longest indexed prefix wins; named affinity when it is also the lane's backend
    ([C("a", cached=500), C("b", cached=900), C("c")], None, ("b", "index_hit", 900)),
    ([C("a", cached=500), C("b", cached=900), C("c")], "b", ("b", "affinity", 900)),
    # a hit too short to matter does not beat the lane
    ([C("a", cached=10), C("b")], "b", ("b", "affinity", 0)),
    # the hit's queue is longer by > 2 per slot and > 2x: balance to the least loaded
    ([C("a", load=6, cached=900), C("b", load=1), C("c", load=2)], None, ("b", "balance", 0)),
    # ... but a moderately longer queue keeps affinity
    ([C("a", load=3, cached=900), C("b", load=1)], None, ("a", "index_hit", 900)),
    # the lane's backend is down: failover to the least loaded
    ([C("a", up=False), C("b", load=2), C("c", load=1)], "a", ("c", "failover", 0)),
    # everything down: the first, as a failover attempt
    ([C("a", up=False), C("b", up=False)], None, ("a", "failover", 0)),
])
def test_decision_table(cands, affinity, want):
    d = decide(cands, affinity, "conv", Balance())
    assert (d.name, d.reason, d.predicted) == want


@pytest.mark.parametrize(("cands", "affinity", "balance", "want"), [
    # queue 6 against 1: 5 more per slot and 6x; balanced away at the defaults ...
    ([C("a", load=6, cached=900), C("b", load=1)], None, Balance(), ("b", "balance")),
    # ... kept with a larger absolute slack, or a larger ratio
    ([C("a", load=6, cached=900), C("b", load=1)], None, Balance(slack=5), ("a", "index_hit")),
    ([C("a", load=6, cached=900), C("b", load=1)], None, Balance(ratio=6.0), ("a", "index_hit")),
    # 3 against 1 keeps affinity at the defaults; a slack of 1 balances it away
    ([C("a", load=3, cached=900), C("b", load=1)], None, Balance(), ("a", "index_hit")),
    ([C("a", load=3, cached=900), C("b", load=1)], None, Balance(slack=1), ("b", "balance")),
    # the slack counts per slot: a 4-slot backend absorbs 4x more
    ([C("a", load=12, cached=900, slots=4), C("b", load=1)], None, Balance(slack=3),
     ("a", "index_hit")),
    ([C("a", load=12, cached=900, slots=4), C("b", load=1)], None, Balance(slack=2),
     ("b", "balance")),
    # a short shared prefix draws the request away from the lane only below min_hit_tokens
    ([C("a", cached=10), C("b")], "b", Balance(), ("b", "affinity")),
    ([C("a", cached=10), C("b")], "b", Balance(min_hit_tokens=8), ("a", "index_hit")),
    # the lane's backend is held to the same test
    ([C("a", load=3), C("b", load=1)], "a", Balance(), ("a", "affinity")),
    ([C("a", load=3), C("b", load=1)], "a", Balance(slack=1, ratio=3.0), ("a", "affinity")),
    ([C("a", load=3), C("b", load=1)], "a", Balance(slack=1, ratio=1.5), ("b", "balance")),
])
def test_balance_thresholds_change_decisions(cands, affinity, balance, want):
    d = decide(cands, affinity, "conv", balance)
    assert (d.name, d.reason) == want


@pytest.mark.parametrize(("target", "have", "min_tokens", "want"), [
    # the worker holding (or computing) the most, when it beats the target by min_tokens
    ("b", {"a": 900, "b": 0, "c": 400}, 256, ("a", 900)),
    ("b", {"a": 900, "b": 700, "c": 400}, 256, None),          # the target holds nearly as much
    ("b", {"a": 900, "b": 644, "c": 0}, 256, ("a", 900)),      # exactly min_tokens more
    ("a", {"a": 900, "b": 1200}, 256, ("b", 1200)),
    ("b", {"a": 500, "b": 0, "c": 500}, 256, ("a", 500)),      # ties: configuration order
    ("b", {"b": 0}, 256, None),                                 # nobody else moves state
    ("b", {"a": 5000, "b": 0}, 0, None),                        # 0: transfers off
    ("b", {"a": 100, "b": 0}, 256, None),                       # too short to be worth it
])
def test_transfer_source_table(target, have, min_tokens, want):
    assert transfer_source(target, have, min_tokens) == want


def test_balance_thresholds_are_settings(monkeypatch):
    assert Settings(_env_file=None).route_balance_slack == Balance().slack
    monkeypatch.setenv("PREFIXD_ROUTE_BALANCE_SLACK", "5")
    monkeypatch.setenv("PREFIXD_ROUTE_BALANCE_RATIO", "3.5")
    monkeypatch.setenv("PREFIXD_ROUTE_MIN_HIT_TOKENS", "100")
    s = Settings(_env_file=None, backends=[{"name": "a", "kind": "openai",
                                            "url": "http://127.0.0.1:9", "models": ["m"]}])
    proxy = make_proxy(s, build_backends(s.backends, s))
    assert proxy.router.balance == Balance(slack=5, ratio=3.5, min_hit_tokens=100)
    monkeypatch.setenv("PREFIXD_ROUTE_BALANCE_RATIO", "0.5")     # below 1 would always yield
    with pytest.raises(ValueError, match="route_balance_ratio"):
        Settings(_env_file=None)


def test_new_conversations_spread_evenly_and_consistently():
    names = ["a", "b", "c"]
    picks = collections.Counter(rendezvous(f"conv-{i}", names) for i in range(600))
    assert set(picks) == set(names) and min(picks.values()) > 150   # even within ~25%
    # order does not matter, and a removed backend only moves its own share
    assert all(rendezvous(f"k{i}", names) == rendezvous(f"k{i}", names[::-1])
               for i in range(100))
    moved = [i for i in range(300) if rendezvous(f"k{i}", names) != "c"
             and rendezvous(f"k{i}", ["a", "b"]) != rendezvous(f"k{i}", names)]
    assert moved == []
    d = decide([C("a"), C("b"), C("c")], None, "conv-1")
    assert d.reason == "new" and d.name == rendezvous("conv-1", names)


def body(system: str, turns: list[str]) -> dict:
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user", "content": t})
        if i < len(turns) - 1:
            msgs.append({"role": "assistant", "content": f"answer {i}"})
    return {"model": "m", "messages": msgs}


def test_prefix_index_longest_forget_and_expiry():
    idx = PrefixIndex(max_entries=1000, ttl_s=100.0)
    t1 = boundaries(flatten(body("sys " * 200, ["one " * 50])))
    t2 = boundaries(flatten(body("sys " * 200, ["one " * 50, "two"])))
    other = boundaries(flatten(body("sys " * 200, ["else " * 50])))
    idx.record("a", t1, now=0.0, exact_tokens=280)
    assert idx.longest(t2, now=1.0)["a"] == (280, True)   # all of turn 1, its own, exact
    shared, own = idx.longest(other, now=1.0)["a"]
    assert 0 < shared < 240 and not own                    # the shared system prompt only
    idx.forget("a", t1, after_tokens=100)                  # it reported fewer cached tokens
    assert idx.longest(t2, now=2.0)["a"][0] <= 100
    idx.record("b", t1, now=0.0)
    assert idx.longest(t2, now=500.0)["b"] == (0, False)   # expired
    idx.forget("a")
    assert idx.size("a") == 0
    assert t1.key == t2.key != other.key                   # the conversation's stable head


@pytest.fixture
async def three():
    ups = [FakeUpstream() for _ in range(3)]
    for u in ups:
        await u.start()
    yield ups
    for u in ups:
        u.release.set()
        await u.stop()


def backends(ups: list[FakeUpstream]) -> list[dict]:
    return [{"name": f"b{i}", "kind": "openai", "url": u.url, "models": ["m"]}
            for i, u in enumerate(ups)]


async def play(http, proxy, convs: int, turns: int) -> dict[str, list[str]]:
    """Interleaved conversations with one shared system prompt and no session id;
    conversation -> the backend of each turn."""
    seen: dict[str, list[str]] = collections.defaultdict(list)
    base = f"http://127.0.0.1:{proxy.port}/v1/chat/completions"
    for t in range(turns):
        for c in range(convs):
            b = body("You are a coding agent. " * 40, [f"task {c}: step {k}" for k in range(t + 1)])
            async with http.post(base, json=b) as r:
                assert r.status == 200
                seen[f"c{c}"].append(r.headers["X-Prefixd-Backend"])
    return seen


async def test_conversations_stick_and_spread_across_backends(three, start_proxy, http):
    proxy = await start_proxy(backends=backends(three), prefix_detect=False)
    seen = await play(http, proxy, convs=9, turns=3)
    assert all(len(set(v)) == 1 for v in seen.values()), seen     # each stays where it began
    firsts = collections.Counter(v[0] for v in seen.values())
    assert len(firsts) == 3                                        # new ones spread


async def test_two_replicas_route_a_conversation_the_same_way(three, start_proxy, http):
    """Two proxies that share nothing, turns alternating between them."""
    p1 = await start_proxy(backends=backends(three))
    p2 = await start_proxy(backends=backends(three))
    for c in range(6):
        got = []
        for t in range(4):
            proxy = (p1, p2)[t % 2]
            b = body("shared system prompt " * 30, [f"conv {c} turn {k}" for k in range(t + 1)])
            async with http.post(f"http://127.0.0.1:{proxy.port}/v1/chat/completions",
                                 json=b) as r:
                got.append(r.headers["X-Prefixd-Backend"])
        assert len(set(got)) == 1, (c, got)


async def test_a_backend_that_goes_down_fails_over_and_is_forgotten(three, start_proxy, http):
    proxy = await start_proxy(backends=backends(three), prefix_detect=False)
    seen = await play(http, proxy, convs=6, turns=1)
    victim = seen["c0"][0]
    ups = dict(zip(["b0", "b1", "b2"], three, strict=True))
    await ups[victim].stop()
    await proxy.proxy.backends[victim].probe_once()             # the health probe notices
    seen2 = await play(http, proxy, convs=6, turns=2)
    assert all(v[-1] != victim for v in seen2.values())
    assert proxy.proxy.router.prefixes.size(victim) == 0


async def test_backend_truth_corrects_the_index(three, start_proxy, http):
    """A backend that reports fewer cached tokens than predicted is counted, and the index
    stops claiming that prefix for it; the header shows the prediction."""
    from prefixd.metrics import proxy as m

    proxy = await start_proxy(backends=backends(three[:1]))
    base = f"http://127.0.0.1:{proxy.port}/v1/chat/completions"
    before = m.ROUTE_MISPREDICTIONS.labels("b0")._value.get()
    turns = ["first question " * 20]
    first = {**body("sys " * 100, turns), "fake": {"usage": {"prompt_tokens": 300,
                                                            "cached_tokens": 0}}}
    async with http.post(base, json=first) as r:
        assert r.status == 200
    turns.append("second")
    forgetful = {**body("sys " * 100, turns), "fake": {"usage": {"prompt_tokens": 400,
                                                                "cached_tokens": 0}}}
    async with http.post(base, json=forgetful) as r:
        assert r.status == 200
        predicted = int(r.headers["X-Prefixd-Prefix"].split("predicted=")[1].split(";")[0])
    assert predicted > 100
    assert m.ROUTE_MISPREDICTIONS.labels("b0")._value.get() == before + 1
    # what it holds now is what it just computed, at the size it reported
    held = proxy.proxy.router.prefixes.longest(boundaries(flatten(body("sys " * 100, turns))),
                                               now=0.0)
    assert held["b0"] == (400, True)


@pytest.mark.parametrize("usage", [{"prompt_tokens": -5, "cached_tokens": -1},
                                   {"prompt_tokens": True, "cached_tokens": "x"},
                                   {"prompt_tokens": 10**30, "cached_tokens": None}])
async def test_nonsense_usage_from_an_upstream_is_ignored(three, start_proxy, http, usage):
    """Found by the long fuzz run: a negative prompt_tokens made the index predict a
    negative count, and the metric refused it (a 500 on the next turn)."""
    proxy = await start_proxy(backends=backends(three[:1]))
    base = f"http://127.0.0.1:{proxy.port}/v1/chat/completions"
    turns = ["first question " * 20]
    for _ in range(3):
        async with http.post(base, json={**body("sys " * 50, turns),
                                         "fake": {"usage": usage}}) as r:
            assert r.status == 200
        turns.append("more")


async def test_status_shows_what_each_backend_holds_and_how_predictions_held(
        three, start_proxy, http):
    """/status per backend: the conversations its index holds with their tokens (the largest
    first), and the predicted against the reported cached tokens; a backend that goes down
    shows none."""
    proxy = await start_proxy(backends=backends(three))
    base = f"http://127.0.0.1:{proxy.port}/v1/chat/completions"
    where: dict[int, str] = {}
    for t in range(2):
        for c in range(6):
            # the upstream says it computed everything: turn 2's prediction is a miss
            b = {**body("You are a coding agent. " * 40,
                        [f"task {c}: step {k} " * (c + 1) for k in range(t + 1)]),
                 "fake": {"usage": {"prompt_tokens": 300 * (t + 1) + 10 * c,
                                    "cached_tokens": 0}}}
            async with http.post(base, json=b) as r:
                assert r.status == 200
                where[c] = r.headers["X-Prefixd-Backend"]
    async with http.get(f"http://127.0.0.1:{proxy.port}/status") as r:
        status = {b["name"]: b for b in (await r.json())["backends"]}
    per_backend = collections.Counter(where.values())
    for name, b in status.items():
        ix = b["index"]
        mine = sorted((600 + 10 * c for c, n in where.items() if n == name), reverse=True)
        assert ix["conversations"] == len(mine)
        assert [t["tokens"] for t in ix["top"]] == mine[:5]     # the reported prompt sizes
        assert ix["tokens"] == sum(mine) and ix["entries"] == b["index_entries"]
        assert ix["reported_tokens"] == 0
        # every second turn (and a first turn predicted on a shared system prompt) missed
        assert per_backend.get(name, 0) <= ix["mispredictions"] <= 2 * len(mine)
        assert ix["predicted_tokens"] >= 250 * len(mine)
    victim = where[0]
    await three[int(victim[1])].stop()
    await proxy.proxy.backends[victim].probe_once()
    async with http.post(base, json=body("x " * 40, ["new"])) as r:  # routing sees the epoch
        assert r.status == 200
    async with http.get(f"http://127.0.0.1:{proxy.port}/status") as r:
        status = {b["name"]: b for b in (await r.json())["backends"]}
    assert status[victim]["index"]["conversations"] == 0
    assert status[victim]["index"]["top"] == []


async def test_the_index_caps_are_settings(three, start_proxy, http):
    """PREFIXD_ROUTE_INDEX_ENTRIES bounds each backend's index (least recently used dropped);
    PREFIXD_ROUTE_INDEX_TTL_S ages entries out."""
    proxy = await start_proxy(backends=backends(three[:1]), route_index_entries=100,
                              route_index_ttl_s=5.0)
    base = f"http://127.0.0.1:{proxy.port}/v1/chat/completions"
    turns: list[str] = []
    for t in range(60):                   # one conversation of 60 turns: 120+ boundaries
        turns.append(f"step {t}")
        async with http.post(base, json=body("sys " * 20, turns)) as r:
            assert r.status == 200
        turns.append(f"answer {t}")
    prefixes = proxy.proxy.router.prefixes
    assert prefixes.size("b0") == 100
    chain = boundaries(flatten(body("sys " * 20, turns[:-1])))
    now = time.monotonic()
    assert prefixes.longest(chain, now)["b0"][0] > 0           # the newest turn is held
    assert prefixes.longest(chain, now + 6.0)["b0"] == (0, False)   # aged out


async def test_a_killed_backend_loses_no_request_and_rejoins_when_back(three, start_proxy,
                                                                       http):
    """A backend killed with a request in flight and more queued for it: the one in flight
    (no response byte yet) and the queued ones are served by the others, its index entries
    are dropped, and once it answers probes again new conversations reach it again."""
    from prefixd.metrics import proxy as m

    cfg = [{**b, "max_concurrency": 1, "health_interval_s": 3600} for b in backends(three)]
    proxy = await start_proxy(backends=cfg)
    base = f"http://127.0.0.1:{proxy.port}/v1/chat/completions"
    sys_prompt = "You are a coding agent. " * 30

    def turn(c: int, t: int, **fake: Any) -> dict:
        return {**body(sys_prompt, [f"conv {c} step {k}" for k in range(t + 1)]),
                **({"fake": fake} if fake else {})}

    home: dict[int, str] = {}
    for c in range(9):
        async with http.post(base, json=turn(c, 0)) as r:
            assert r.status == 200
            home[c] = r.headers["X-Prefixd-Backend"]
    victim = home[0]
    ups = dict(zip(["b0", "b1", "b2"], three, strict=True))
    mine = [c for c in home if home[c] == victim]
    assert proxy.proxy.router.prefixes.size(victim) > 0
    failovers = m.ROUTE_DECISIONS.labels("b0", "failover")._value.get() + \
        m.ROUTE_DECISIONS.labels("b1", "failover")._value.get() + \
        m.ROUTE_DECISIONS.labels("b2", "failover")._value.get()

    async def send(c: int, **fake: Any) -> tuple[int, str]:
        async with http.post(base, json=turn(c, 1, **fake)) as r:
            await r.read()
            return r.status, r.headers.get("X-Prefixd-Backend", "")

    for name, u in ups.items():
        if name != victim:
            u.release.set()                  # "hold" holds only on the victim
    held = asyncio.create_task(send(mine[0], hold=True))       # in flight on the victim
    await ups[victim].wait_received(len(ups[victim].received) + 1)
    others = [u for name, u in ups.items() if name != victim]
    elsewhere = sum(len(u.received) for u in others)
    queued = [asyncio.create_task(send(c)) for c in [*mine[1:], mine[0]]]
    deadline = time.monotonic() + 10
    while (proxy.proxy.queues[victim].waiting      # each waits on the victim (affinity) or
           + sum(len(u.received) for u in others) - elsewhere < len(queued)):  # was balanced
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    waiting = proxy.proxy.queues[victim].waiting
    assert waiting >= 1
    await ups[victim].kill()                 # the held request's connection drops
    results = await asyncio.gather(held, *queued)
    assert all(status == 200 for status, _ in results), results
    assert all(b != victim for _, b in results), results
    assert proxy.proxy.router.prefixes.size(victim) == 0
    assert not proxy.proxy.backends[victim].status().up
    after = sum(m.ROUTE_DECISIONS.labels(b, "failover")._value.get() for b in ups)
    assert after - failovers == 1 + waiting  # each request that was on the victim, once
    await ups[victim].start()                # back on the same port
    assert await proxy.proxy.backends[victim].probe_once()
    for c in range(9, 40):                   # new conversations spread onto it again
        async with http.post(base, json=turn(c, 0)) as r:
            assert r.status == 200
            if r.headers["X-Prefixd-Backend"] == victim:
                break
    else:
        raise AssertionError("the recovered backend got no new conversation")


async def test_a_stream_that_waited_in_a_killed_backends_queue_fails_over_and_streams(
        three, start_proxy, http):
    """A streaming request already told `: queued position=N` in the queue of a backend that
    is then killed waits in the next backend's queue on the same response, then streams."""
    ups = dict(zip(["b0", "b1"], three[:2], strict=True))
    cfg = [{**b, "max_concurrency": 1, "health_interval_s": 3600} for b in backends(three[:2])]
    proxy = await start_proxy(backends=cfg)
    base = f"http://127.0.0.1:{proxy.port}/v1/chat/completions"

    def turn(c: int, t: int, **extra: Any) -> dict:
        return {**body("shared system " * 30, [f"conv {c} step {k}" for k in range(t + 1)]),
                **extra}

    home: dict[int, str] = {}
    for c in range(12):
        async with http.post(base, json=turn(c, 0)) as r:
            home[c] = r.headers["X-Prefixd-Backend"]
    victim, other = home[0], ("b1" if home[0] == "b0" else "b0")
    on_other = next(c for c in home if home[c] == other)

    async def send(c: int, t: int, **extra: Any) -> tuple[int, bytes]:
        async with http.post(base, json=turn(c, t, **extra)) as r:
            return r.status, await r.read()

    busy_other = asyncio.create_task(send(on_other, 1, fake={"hold": True}))
    await ups[other].wait_received(len(ups[other].received) + 1)
    busy_victim = asyncio.create_task(send(0, 1, fake={"hold": True}))
    await ups[victim].wait_received(len(ups[victim].received) + 1)
    stream = asyncio.create_task(send(0, 2, stream=True))
    deadline = time.monotonic() + 10
    while proxy.proxy.queues[victim].waiting < 1:          # the stream waits on the victim
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    await ups[victim].kill()
    deadline = time.monotonic() + 10
    while proxy.proxy.queues[other].waiting < 2:           # both wait on the other backend
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    ups[other].release.set()
    (s1, _), (s2, _), (s3, streamed) = await asyncio.gather(busy_other, busy_victim, stream)
    assert (s1, s2, s3) == (200, 200, 200)
    text = streamed.decode()
    assert text.startswith(": queued position=") and "data: [DONE]" in text
    assert '"content"' in text


ROLE_ONLY = ('data: {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": '
             '[{"index": 0, "delta": {"role": "assistant"}, "finish_reason": null}]}\n\n')


@pytest.mark.parametrize("api", ["chat", "anthropic"])
async def test_a_stream_whose_backend_dies_before_the_answer_is_answered_by_another(
        three, start_proxy, http, api):
    """A backend killed during its prefill has sent the stream's headers and a role-only
    chunk, nothing of the answer: the client gets one whole answer from another backend,
    with one start (the role chunk was held back), not an error event."""
    calls: list[str] = []

    def responder(up: str):                     # the first backend asked dies, later ones answer
        def respond(body: dict) -> dict:
            calls.append(up)
            if len(calls) == 1:
                return {"raw": [ROLE_ONLY], "drop": True}
            return {"reply": {"content": "the whole answer"}}
        return respond

    for i, up in enumerate(three[:2]):
        up.responder = responder(f"b{i}")
    proxy = await start_proxy(backends=[{**b, "health_interval_s": 3600}
                                        for b in backends(three[:2])])
    base = f"http://127.0.0.1:{proxy.port}"
    if api == "chat":
        req = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        path = "/v1/chat/completions"
    else:
        req = {"model": "m", "stream": True, "max_tokens": 20,
               "messages": [{"role": "user", "content": "hi"}]}
        path = "/v1/messages"
    async with http.post(base + path, json=req) as r:
        assert r.status == 200
        text = (await r.read()).decode()
    assert len(calls) == 2 and calls[0] != calls[1]          # sent again, elsewhere
    assert "error" not in text
    if api == "chat":
        events = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]
        roles = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("role")]
        assert len(roles) == 1 and text.rstrip().endswith("data: [DONE]")
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                       if e["choices"]) == "the whole answer"
    else:
        assert text.count("event: message_start") == 1
        assert text.count("event: message_stop") == 1
        assert "the whole answer" in "".join(
            json.loads(line[6:]).get("delta", {}).get("text", "")
            for line in text.splitlines() if line.startswith("data: {"))
