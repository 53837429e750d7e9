"""The router follows what backends announce (issue 49 item 2): `prefixd serve` over two
prefixd workers (a tiny hybrid: recurrent state restores only at checkpoints) that publish KV
events, each conversation warmed on one of them directly, outside the router. Its follow-ups,
sent through the router, land on the worker that holds them, predicted exactly (from the
events: `predicted_from` kv_events) as the worker then reports; /status shows the streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from worker_process import free_port

from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.server.app import create_app
from prefixd.backends.mlx.settings import WorkerSettings
from tests.worker_fixtures import loaded

CONVERSATIONS = 6        # warmed alternately: all on the right worker by luck, 1 in 64
DEADLINE = 30.0


def _settings(port: int) -> WorkerSettings:
    return WorkerSettings(_env_file=None, use_system_blas=False, max_tokens_default=4,
                          kv_events=f"tcp://127.0.0.1:{port}",
                          kv_events_replay=f"tcp://127.0.0.1:{port + 1}")


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Callable[[str], Path]) -> Iterator[list[tuple[Generator, int]]]:
    model = str(tiny_model_dir("qwen3_next"))
    out = []
    for _ in range(2):
        port = free_port(pair=True)     # the replay endpoint takes the port after it
        gen = Generator(_settings(port))
        out.append((loaded(gen, model), port))
    yield out
    for gen, _ in out:
        gen.close()


@pytest.fixture
async def served(workers: list[tuple[Generator, int]], start_proxy: Any
                 ) -> AsyncIterator[tuple[str, list[str]]]:
    """(the proxy's base URL, the workers' base URLs)."""
    servers = [TestServer(create_app(gen, "tiny", _settings(port)), host="127.0.0.1")
               for gen, port in workers]
    for s in servers:
        await s.start_server()
    urls = [f"http://127.0.0.1:{s.port}" for s in servers]
    try:
        proxy = await start_proxy(backends=[
            {"name": f"w{i}", "kind": "prefixd", "url": url, "models": ["tiny"],
             "kv_events": f"tcp://127.0.0.1:{port}",
             "kv_events_replay": f"tcp://127.0.0.1:{port + 1}"}
            for i, (url, (_, port)) in enumerate(zip(urls, workers, strict=True))])
        yield f"http://127.0.0.1:{proxy.port}", urls
    finally:
        for s in servers:
            await s.close()


def _conversation(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"You are agent {i}. " + "Keep every file. " * 40},
            {"role": "user", "content": f"Task {i}: " + "read the module and explain. " * 6}]


async def _chat(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]],
                headers: dict[str, str] | None = None
                ) -> tuple[dict[str, Any], dict[str, str]]:
    async with http.post(url + "/v1/chat/completions", headers=headers or {}, json={
            "model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}) as r:
        assert r.status == 200, await r.text()
        return await r.json(), dict(r.headers)


async def _caught_up(http: aiohttp.ClientSession, proxy: str,
                     workers: list[tuple[Generator, int]]) -> dict[str, Any]:
    """/status once the router applied every batch each worker published (deadline)."""
    deadline = time.monotonic() + DEADLINE
    while True:
        async with http.get(proxy + "/status") as r:
            status = await r.json()
        seen = [b.get("kv_events", {}).get("last_seq") for b in status["backends"]]
        settled = all(gen.announcer is not None and gen.loaded is not None and
                      gen.announcer.settled(gen.loaded.engine.store) for gen, _ in workers)
        sent = [gen.announcer.publisher.sent - 1 for gen, _ in workers
                if gen.announcer is not None]
        if settled and sorted(s for s in seen if s is not None) == sorted(sent):
            return status
        assert time.monotonic() < deadline, f"the router did not catch up: {seen} vs {sent}"
        await asyncio.sleep(0.05)


async def test_follow_ups_of_conversations_warmed_outside_land_where_they_are_held(
        served: tuple[str, list[str]], workers: list[tuple[Generator, int]],
        http: aiohttp.ClientSession) -> None:
    proxy, urls = served
    held_by, follow_ups = {}, {}
    for i in range(CONVERSATIONS):                  # warmed directly, not through the router
        messages = _conversation(i)
        answer, _ = await _chat(http, urls[i % 2], messages)
        held_by[i] = f"w{i % 2}"
        follow_ups[i] = [*messages, answer["choices"][0]["message"],
                         {"role": "user", "content": "Now fix the bug you found. " * 3}]
    status = await _caught_up(http, proxy, workers)
    for i in range(CONVERSATIONS):
        answer, headers = await _chat(http, proxy, follow_ups[i])
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        prefix = dict(p.split("=", 1) for p in headers["X-Prefixd-Prefix"].split(";"))
        assert headers["X-Prefixd-Backend"] == held_by[i]
        assert cached > 0 and int(prefix["predicted"]) == cached, (i, prefix, cached)
    for b in status["backends"]:
        assert b["kv_events"]["state"] == "complete" and b["kv_events"]["blocks"]["GPU"] > 0
    async with http.get(proxy + "/metrics") as r:
        metrics = await r.text()
    assert 'prefixd_kv_events_complete{backend="w0"} 1.0' in metrics
    assert "prefixd_route_event_mispredictions_total{" not in metrics or \
        'prefixd_route_event_mispredictions_total{backend="w0"} 0.0' in metrics


@pytest.mark.parametrize("key", [None, "k3y-for-the-workers"])
async def test_the_gateways_picker_follows_them_too(
        workers: list[tuple[Generator, int]], http: aiohttp.ClientSession,
        key: str | None) -> None:
    """`prefixd picker` (Envoy's ext_proc) over the same workers: each follow-up of a
    conversation warmed directly is picked for the worker that holds it. Workers that need
    a key are asked for token ids with the backend's `api_key`."""
    pytest.importorskip("grpc")
    import json

    from test_picker import Running, exchange

    from prefixd.proxy.picker.server import start
    from prefixd.proxy.settings import Settings

    servers = [TestServer(create_app(gen, "tiny", _settings(port), key), host="127.0.0.1")
               for gen, port in workers]
    for s in servers:
        await s.start_server()
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    settings = Settings(_env_file=None, prefix_detect=False, backends=[
        {"name": f"w{i}", "kind": "prefixd", "url": f"http://{a}", "models": ["tiny"],
         **({"api_key": key} if key else {}),
         "kv_events": f"tcp://127.0.0.1:{port}",
         "kv_events_replay": f"tcp://127.0.0.1:{port + 1}"}
        for i, (a, (_, port)) in enumerate(zip(addresses, workers, strict=True))])
    server, picker, bound, prober = await start(settings, "127.0.0.1", 0)
    running = Running(picker, bound)
    try:
        follow_ups = {}
        for i in range(CONVERSATIONS):
            messages = [{"role": "system", "content": f"Picker agent {i}. " + "Note. " * 50},
                        {"role": "user", "content": f"Job {i}: " + "list the files. " * 6}]
            answer, _ = await _chat(http, "http://" + addresses[(i + 1) % 2], messages, auth)
            follow_ups[i] = [*messages, answer["choices"][0]["message"],
                             {"role": "user", "content": "And the tests? " * 4}]
        deadline = time.monotonic() + DEADLINE
        while not all(gen.announcer is not None and gen.loaded is not None
                      and gen.announcer.settled(gen.loaded.engine.store)
                      and picker.core.follow.feeds[f"w{j}"].status.last_seq
                      == gen.announcer.publisher.sent - 1
                      for j, (gen, _) in enumerate(workers)):
            assert time.monotonic() < deadline, "the picker did not catch up"
            await asyncio.sleep(0.05)
        for i in range(CONVERSATIONS):
            body = json.dumps({"model": "tiny", "messages": follow_ups[i], "max_tokens": 4,
                               "temperature": 0}).encode()
            out = await exchange(running, body)
            assert out.destination[0] == addresses[(i + 1) % 2], i
    finally:
        prober.cancel()
        await running.channel.close()
        await server.stop(0)
        await picker.close()
        for s in servers:
            await s.close()
