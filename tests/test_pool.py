"""Several managed models under one memory budget (issue 16), with fake workers whose
footprints are declared by their cache budgets: at most what fits is loaded, the least
recently used idle model is unloaded to make room, a busy model is never unloaded (the other
waits, a streaming client hears why), and a model that can never fit is a start-up error."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import aiohttp
import psutil
import pytest
from fake_worker import fake_command
from prometheus_client.parser import text_string_to_metric_families
from proxy_fixtures import read_until

from prefixd.backends.budget import PROCESS_OVERHEAD, CacheNeed, cache_shares
from prefixd.backends.managed import ManagedBackend
from prefixd.backends.supervision.states import ProcState
from prefixd.metrics import proxy as m
from prefixd.metrics import render
from prefixd.proxy.server import Server, StartupError, make_proxy, serve
from prefixd.proxy.settings import Settings

MiB = 2**20
CACHE = 100 * MiB
ONE = PROCESS_OVERHEAD + CACHE              # each fake model's footprint


def settings(budget: int, **extra) -> Settings:
    backends = [{"name": n, "kind": "mlx", "model": f"fake-{n}", "models": [n],
                 "cache_bytes": CACHE, **extra.get(n, {})} for n in ("a", "b")]
    return Settings(_env_file=None, prefix_detect=False, use_system_blas=False,
                    model_memory_bytes=budget, backends=backends)


@pytest.fixture
async def start() -> AsyncIterator:
    servers: list[Server] = []

    async def _start(s: Settings, **kw: float) -> tuple[Server, dict[str, ManagedBackend]]:
        managed = [ManagedBackend(c, s, command=fake_command, stop_grace_s=2.0, **kw)
                   for c in s.backends]
        server = Server(make_proxy(s, managed))
        await server.start("127.0.0.1", 0)
        servers.append(server)
        return server, {b.name: b for b in managed}

    yield _start
    for s in servers:
        await s.shutdown(1.0)
    assert psutil.Process().children(recursive=True) == []


def loaded(backends: dict[str, ManagedBackend]) -> list[str]:
    return sorted(n for n, b in backends.items() if b.loaded)


async def ask(http: aiohttp.ClientSession, server: Server, model: str, **fake) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "fake": fake}
    async with http.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def test_models_swap_under_a_budget_for_one(start, http):
    server, backends = await start(settings(int(1.5 * ONE)))
    unloads = m.MODEL_UNLOADS.labels("a", "budget")._value.get()
    await ask(http, server, "a")
    assert loaded(backends) == ["a"]
    for model, other in (("b", "a"), ("a", "b"), ("b", "a")):
        await ask(http, server, model)
        assert loaded(backends) == [model], other          # never both
    assert m.MODEL_UNLOADS.labels("a", "budget")._value.get() == unloads + 2
    async with http.get(f"http://127.0.0.1:{server.port}/v1/models") as r:
        models = {d["id"]: d for d in (await r.json())["data"]}
    assert models["b"]["state"] == "loaded" and models["a"]["state"] == "unloaded"
    assert models["a"]["footprint_bytes"] == ONE


async def test_a_busy_model_is_never_unloaded(start, http):
    server, backends = await start(settings(int(1.5 * ONE)))
    base = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    long = await http.post(base, json={"model": "a", "stream": True, "messages": msgs,
                                       "fake": {"chunks": 40, "delay": 0.05}})
    await read_until(long, b"data: {")
    other = await http.post(base, json={"model": "b", "stream": True, "messages": msgs})
    await read_until(other, b": waiting for a to finish")  # b waits; a keeps streaming
    assert loaded(backends) == ["a"]
    assert (await long.read()).rstrip().endswith(b"data: [DONE]")
    assert (await asyncio.wait_for(other.read(), 30)).rstrip().endswith(b"data: [DONE]")
    assert loaded(backends) == ["b"]
    long.release()
    other.release()


async def test_both_fit_and_groups_and_pins(start, http):
    server, backends = await start(settings(3 * ONE))
    await ask(http, server, "a")
    await ask(http, server, "b")
    assert loaded(backends) == ["a", "b"]                  # the budget fits both
    server2, backends2 = await start(settings(3 * ONE, a={"group": "g"}, b={"group": "g"}))
    await ask(http, server2, "a")
    await ask(http, server2, "b")
    assert loaded(backends2) == ["b"]                      # one group: never together


async def test_a_model_that_cannot_fit_alone_is_a_startup_error():
    with pytest.raises(StartupError, match="PREFIXD_MODEL_MEMORY_BYTES"):
        s = settings(ONE // 2)
        await serve(s.model_copy(update={"port": 0}),
                    [ManagedBackend(c, s, command=fake_command) for c in s.backends])


async def status(http: aiohttp.ClientSession, server: Server) -> dict:
    async with http.get(f"http://127.0.0.1:{server.port}/status") as r:
        return await r.json()


async def test_a_measured_footprint_replaces_the_estimate(start, http):
    """By their estimates both fit; once loaded, `a` reports more memory than estimated, so
    loading `b` now unloads it, and /status shows what was measured."""
    measured_rss = 2 * ONE
    server, backends = await start(settings(3 * ONE, a={"worker_env": {
        "FAKE_WORKER_RSS": str(measured_rss)}}))
    await ask(http, server, "a")
    body = await status(http, server)
    a = next(b for b in body["backends"] if b["name"] == "a")
    assert (a["footprint_bytes"], a["footprint_source"]) == (measured_rss + CACHE, "measured")
    assert body["model_memory"] == {"budget_bytes": 3 * ONE, "loaded": ["a"],
                                    "loaded_bytes": measured_rss + CACHE}
    await ask(http, server, "b")
    assert loaded(backends) == ["b"]
    b = next(x for x in (await status(http, server))["backends"] if x["name"] == "b")
    assert (b["footprint_bytes"], b["footprint_source"]) == (ONE, "estimate")  # no report


async def test_models_without_a_cache_budget_get_shares_that_fit_together(start, http):
    budget = 4 * 2**30
    s = settings(budget)
    s = s.model_copy(update={"backends": [c.model_copy(update={"cache_bytes": None})
                                          for c in s.backends]})
    server, backends = await start(s)
    share = cache_shares([CacheNeed("a", 0, None), CacheNeed("b", 0, None)], budget)["a"]
    await ask(http, server, "a")
    await ask(http, server, "b")
    assert loaded(backends) == ["a", "b"]
    body = await status(http, server)
    # each worker was started with its share as PREFIXD_CACHE_BYTES (it reports it back)
    assert [b["cache"]["budget"] for b in body["backends"]] == [share, share]
    assert [b["footprint_bytes"] for b in body["backends"]] == [PROCESS_OVERHEAD + share] * 2
    assert 2 * (PROCESS_OVERHEAD + share) <= budget


def samples(text: str) -> dict[tuple, float]:
    return {(s.name, *sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


async def scrape(http: aiohttp.ClientSession, server: Server) -> dict[tuple, float]:
    async with http.get(f"http://127.0.0.1:{server.port}/metrics") as r:
        return samples(await r.text())


async def test_loads_unloads_waits_and_bytes_reach_metrics(start, http):
    """/metrics of a real proxy: loads (and their seconds), unloads by reason (budget, group,
    ttl, failure), the requests that waited for a load, and the bytes each loaded model holds."""
    before = samples(render().decode())

    def delta(after: dict, name: str, **labels: str) -> float:
        key = (name, *sorted(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    server, backends = await start(settings(int(1.5 * ONE)))     # a starts at start-up
    for model in ("a", "b", "a"):                  # b unloads a, a unloads b: budget
        await ask(http, server, model)
    os.kill(backends["a"].status().detail["pid"], signal.SIGKILL)     # a crashes: failure
    await backends["a"].wait_for(ProcState.STOPPED, ProcState.STARTING, timeout=30)
    await backends["a"].wait_for(ProcState.READY, timeout=30)        # restarted
    await ask(http, server, "b")                   # b unloads a again
    _, idle_backends = await start(settings(3 * ONE, a={"ttl_s": 0.3}))   # both start
    await idle_backends["a"].wait_for(ProcState.READY, timeout=30)
    await idle_backends["a"].wait_for(ProcState.STOPPED, timeout=30)       # idle: ttl
    grouped, _ = await start(settings(3 * ONE, a={"group": "g"}, b={"group": "g"}))
    await ask(http, grouped, "a")
    await ask(http, grouped, "b")                  # same group: group
    after = await scrape(http, grouped)
    assert delta(after, "prefixd_model_unloads_total", backend="a", reason="budget") == 2
    assert delta(after, "prefixd_model_unloads_total", backend="b", reason="budget") == 1
    assert delta(after, "prefixd_model_unloads_total", backend="a", reason="failure") == 1
    assert delta(after, "prefixd_model_unloads_total", backend="a", reason="ttl") == 1
    assert delta(after, "prefixd_model_unloads_total", backend="a", reason="group") == 1
    # a: at start-up, after b, after its crash, at the start-up of `idle` and of `grouped`
    assert delta(after, "prefixd_model_loads_total", backend="a", outcome="ready") == 5
    assert delta(after, "prefixd_model_load_seconds_count", backend="a") == 5
    assert delta(after, "prefixd_model_load_seconds_sum", backend="a") > 0
    # every request that found b not ready waited for its load: two here, one in `grouped`
    assert delta(after, "prefixd_model_load_wait_seconds_count", backend="b") == 3
    # what `grouped` holds now: b, by its estimate
    assert after[("prefixd_model_loaded_bytes", ("backend", "b"))] == ONE
    assert after[("prefixd_model_loaded_bytes", ("backend", "a"))] == 0
    assert after[("prefixd_model_footprint_bytes", ("backend", "a"))] == ONE
    assert after[("prefixd_model_memory_budget_bytes",)] == 3 * ONE


async def test_a_crashed_model_does_not_restart_beside_the_one_that_took_its_room(start, http):
    server, backends = await start(settings(int(1.5 * ONE)))
    await ask(http, server, "a")
    os.kill(backends["a"].status().detail["pid"], signal.SIGKILL)
    await ask(http, server, "b")      # a is being restarted (or about to be): b unloads it
    assert loaded(backends) == ["b"]
    assert backends["a"].status().state == "stopped"


async def test_a_failed_pooled_model_is_retried_only_through_the_pool(start, http, tmp_path):
    """A failed backend's scheduled retry would start its worker without the pool's say (two
    workers under a budget for one): under a pool it starts only if it fits beside what is
    loaded; otherwise an admitted request retries it."""
    broken = tmp_path / "broken"
    broken.touch()
    s = settings(int(1.5 * ONE), a={"worker_env": {"FAKE_WORKER_BROKEN": str(broken)},
                                    "retry_failed_s": 0.1, "max_restarts": 1})
    server, backends = await start(s, retry_min_s=0.0)
    body = {"model": "a", "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=body) as r:
        assert r.status == 503
    assert await backends["a"].wait_for(ProcState.FAILED, timeout=10) is ProcState.FAILED
    await ask(http, server, "b")
    broken.unlink()                                # a could load now, if anything started it
    starts = m.MODEL_LOADS.labels("a", "failed")._value.get()
    await asyncio.sleep(1.0)                       # ten scheduled retry periods
    assert loaded(backends) == ["b"]
    assert m.MODEL_LOADS.labels("a", "failed")._value.get() == starts
    await ask(http, server, "a")                   # a request, admitted by the pool, retries
    assert loaded(backends) == ["a"]


async def test_a_request_for_a_model_being_unloaded_waits_for_the_pool(start, http):
    """A request for a model whose worker is still stopping (unloaded to make room) must not
    restart it beside the model that took its room: it waits, then goes through the pool."""
    s = settings(int(1.5 * ONE), a={"worker_env": {"FAKE_WORKER_MODE": "ignore_term"}})
    server, backends = await start(s)
    await ask(http, server, "a")
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, sum(b.ready for b in backends.values()))
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    try:
        to_b = asyncio.create_task(ask(http, server, "b", chunks=20, delay=0.05))
        await backends["a"].wait_for(ProcState.STOPPING, timeout=10)  # a ignores SIGTERM: slow
        await ask(http, server, "a")
        await to_b
    finally:
        watcher.cancel()
    assert most == 1
    assert loaded(backends) == ["a"]


async def test_groups_beside_a_single_worker_that_fit_together_stay_loaded(start, http):
    """Issue 47: a group's ranks each run a process with a cache of the worker's budget. One
    worker, a two-rank group and a three-rank group with a rank on another host (which counts
    against that host), their ranks each holding a process's overhead: their shares of the
    budget fit them together, so they all load and requests alternating between them unload
    nothing; each measures, per rank here, a process and the budget its workers were given.
    (Before, a group's ranks each took the group's whole share: it measured twice its
    estimate, and every load of one model unloaded another.)"""
    budget = 4 * 2**30
    hosts = {"one": [], "pair": ["127.0.0.1"] * 2,
             "trio": ["127.0.0.1", "127.0.0.1", "10.255.0.9"]}
    s = Settings(_env_file=None, prefix_detect=False, use_system_blas=False,
                 model_memory_bytes=budget, backends=[
                     {"name": n, "kind": "mlx", "model": f"fake-{n}", "models": [n], "hosts": h,
                      "worker_env": {"FAKE_WORKER_RSS": str(PROCESS_OVERHEAD)}}
                     for n, h in hosts.items()])
    unloads = {n: m.MODEL_UNLOADS.labels(n, "budget")._value.get() for n in hosts}
    server, backends = await start(s)
    for model in ("one", "pair", "trio", "one", "pair", "trio", "one"):
        await ask(http, server, model)
    assert loaded(backends) == ["one", "pair", "trio"]
    assert {n: m.MODEL_UNLOADS.labels(n, "budget")._value.get() for n in hosts} == unloads
    body = await status(http, server)
    here = {"one": 1, "pair": 2, "trio": 2}
    assert {b["name"]: (b["footprint_bytes"], b["footprint_source"]) for b in body["backends"]} \
        == {b["name"]: (here[b["name"]] * (PROCESS_OVERHEAD + b["cache"]["budget"]), "measured")
            for b in body["backends"]}
    assert body["model_memory"]["loaded_bytes"] <= budget
