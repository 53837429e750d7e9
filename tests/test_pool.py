"""Several managed models under one memory budget (issue 16), with fake workers whose
footprints are declared by their cache budgets: at most what fits is loaded, the least
recently used idle model is unloaded to make room, a busy model is never unloaded (the other
waits, a streaming client hears why), and a model that can never fit is a start-up error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import psutil
import pytest
from fake_worker import fake_command
from proxy_fixtures import read_until

from prefixd.backends.budget import PROCESS_OVERHEAD
from prefixd.backends.managed import ManagedBackend
from prefixd.metrics import proxy as m
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

    async def _start(s: Settings) -> tuple[Server, dict[str, ManagedBackend]]:
        managed = [ManagedBackend(c, s, command=fake_command, stop_grace_s=2.0)
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
