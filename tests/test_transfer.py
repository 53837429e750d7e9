"""Prefix state moves between prefixd workers (issue 17): two real worker processes of one
tiny hybrid model (Gated-DeltaNet) behind one proxy. A conversation routed to the worker that
never saw its shared system prompt gets that prefix's state copied in from the worker that
holds it — or is still computing it — instead of recomputing it, and answers exactly as the
holder does; a worker of another model refuses the state (409) and the request is served
cold, once, without a second attempt."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import SecretStr
from worker_process import running_worker

from prefixd.backends.config import BackendConfig
from prefixd.backends.supervision.process import (
    TRANSFER_SECRET_ENV,
    run_transfer_secret,
    worker_command,
    worker_env,
)
from prefixd.proxy.prefix.segments import flatten
from prefixd.proxy.routing.index import boundaries
from prefixd.proxy.routing.policy import rendezvous
from prefixd.proxy.settings import Settings

SYSTEM = "You are a careful agent working in a large repository. Keep every rule. " * 12
KEY = "k3y"
SIGNED = {"PREFIXD_TRANSFER_SECRET": "the transfer secret of these workers"}


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Callable[[str], Path]) -> Iterator[list[str]]:
    model = tiny_model_dir("qwen3_next")
    with running_worker(model, KEY, **SIGNED) as a, running_worker(model, KEY, **SIGNED) as b:
        yield [a, b]


def _backends(urls: list[str], **extra: Any) -> list[dict[str, Any]]:
    return [{"name": f"w{i}", "kind": "prefixd", "url": u, "api_key": KEY, "models": ["tiny"],
             **extra} for i, u in enumerate(urls)]


def _body(user: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "temperature": 0, "max_tokens": 4, **extra, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}


async def _ask(http: aiohttp.ClientSession, url: str, body: dict[str, Any]
               ) -> tuple[str, dict[str, Any]]:
    """(the backend that answered, the answer, with the proxy's prediction as `predicted`)."""
    async with http.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        header = r.headers.get("X-Prefixd-Prefix", "")
        answer = await r.json()
        answer["predicted"] = int(header.split("predicted=")[1].split(";")[0])
        return r.headers.get("X-Prefixd-Backend", ""), answer


def _cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _metric(http: aiohttp.ClientSession, base: str, line_start: str) -> float:
    async with http.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}) as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(line_start))


def _goes_to(body: dict[str, Any]) -> str:
    """Where the proxy sends a new conversation: the rendezvous choice on its head."""
    return rendezvous(boundaries(flatten(body)).key, ["w0", "w1"])


def _conversation_to(backend: str, tag: str, system: str = SYSTEM) -> str:
    """A first user message whose new conversation the proxy sends to `backend`."""
    for i in range(64):
        user = f"{tag} question {i}: which file holds the parser?"
        body = _body(user)
        body["messages"][0]["content"] = system
        if _goes_to(body) == backend:
            return user
    raise AssertionError(f"no conversation goes to {backend}")


def _other_conversation(first: str, tag: str, system: str = SYSTEM) -> str:
    """A first user message whose new conversation the proxy sends to the other backend."""
    return _conversation_to("w1" if first == "w0" else "w0", tag, system)


async def test_a_new_conversation_gets_the_shared_prefix_from_the_worker_holding_it(
        workers: list[str], start_proxy: Any, http: aiohttp.ClientSession) -> None:
    server = await start_proxy(backends=_backends(workers), route_transfer_min_tokens=64)
    base = f"http://127.0.0.1:{server.port}"
    first, _ = await _ask(http, base + "/v1/chat/completions", _body("held: list the files"))
    user = _other_conversation(first, "held")
    second = "w1" if first == "w0" else "w0"
    moved = ('prefixd_route_transfers_total{outcome="moved",'
             f'source="{first}",target="{second}"}}')
    tokens = f'prefixd_route_transfer_tokens_total{{target="{second}"}}'
    before = await _metric(http, base, moved), await _metric(http, base, tokens)
    got, two = await _ask(http, base + "/v1/chat/completions", _body(user))
    assert got == second
    # the worker never saw the system prompt: its state came from the first worker
    assert 0 < _cached(two) < two["usage"]["prompt_tokens"]
    assert two["predicted"] == _cached(two)          # the copy is what routing predicts
    assert await _metric(http, base, moved) - before[0] == 1
    assert await _metric(http, base, tokens) - before[1] == _cached(two)
    # the copied state answers as the holder's own: ask the holder directly
    holder = workers[int(first[1])]
    async with http.post(holder + "/v1/chat/completions", json=_body(user),
                         headers={"Authorization": f"Bearer {KEY}"}) as r:
        own = await r.json()
    assert _cached(own) == _cached(two)
    assert own["choices"][0]["message"] == two["choices"][0]["message"]


async def test_a_prefix_still_being_computed_is_waited_for_then_copied(
        workers: list[str], start_proxy: Any, http: aiohttp.ClientSession) -> None:
    server = await start_proxy(backends=_backends(workers), route_transfer_min_tokens=64,
                               route_transfer_timeout_s=120)
    base = f"http://127.0.0.1:{server.port}"
    system = SYSTEM.replace("careful", "patient")     # a prefix neither worker holds yet

    def body(user: str, **extra: Any) -> dict[str, Any]:
        b = _body(user, **extra)
        b["messages"][0]["content"] = system
        return b

    lead = "computing: list the files"
    first = _goes_to(body(lead))
    # Keep the first worker busy (a long generation sent to it directly), so the first
    # conversation is still waiting there, in flight, when the second one is routed.
    holder = workers[int(first[1])]
    busy = asyncio.create_task(http.post(
        holder + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "tiny", "max_tokens": 600, "messages": [
            {"role": "user", "content": "Count slowly."}]}))
    await asyncio.sleep(0.5)
    one = asyncio.create_task(_ask(http, base + "/v1/chat/completions", body(lead)))
    route = server.proxy.router
    for _ in range(200):                   # until the first conversation is in flight
        if route.inflight.requests(first):
            break
        await asyncio.sleep(0.05)
    assert route.inflight.requests(first) and not route.prefixes.size(first)  # computing, not held
    user = _other_conversation(first, "computing", system)
    second, two = await _ask(http, base + "/v1/chat/completions", body(user))
    assert one.done()                      # the copy waited for the first conversation
    assert second != first and 0 < _cached(two) < two["usage"]["prompt_tokens"]
    (await busy).release()
    await one


async def test_a_worker_of_another_model_refuses_the_state_once(
        workers: list[str], tiny_model_dir: Callable[[str], Path], start_proxy: Any,
        http: aiohttp.ClientSession) -> None:
    with running_worker(tiny_model_dir("qwen3_5"), KEY, **SIGNED) as stranger:
        server = await start_proxy(backends=_backends([workers[0], stranger]),
                                   route_transfer_min_tokens=64)
        base = f"http://127.0.0.1:{server.port}"
        url = base + "/v1/chat/completions"
        tried = "prefixd_route_transfers_total{"
        refused = 'prefixd_route_transfers_total{outcome="refused"'
        before = await _metric(http, base, tried), await _metric(http, base, refused)
        for n, system in enumerate((SYSTEM, SYSTEM.replace("careful", "quiet"))):
            lead = _body(f"stranger {n}: list the files")
            lead["messages"][0]["content"] = system
            first = _goes_to(lead)
            second_body = _body(_other_conversation(first, f"stranger {n}", system))
            second_body["messages"][0]["content"] = system
            assert first == "w0"       # the tiny qwen3_next worker holds it first
            await _ask(http, url, lead)
            second, answer = await _ask(http, url, second_body)
            assert second == "w1" and _cached(answer) == 0    # served cold
        # refused once (409: another model's state), then not tried again
        assert await _metric(http, base, tried) - before[0] == 1
        assert await _metric(http, base, refused) - before[1] == 1


async def test_a_source_that_died_costs_the_copy_not_the_request(
        workers: list[str], tiny_model_dir: Callable[[str], Path], start_proxy: Any,
        http: aiohttp.ClientSession) -> None:
    system = SYSTEM.replace("careful", "lost")
    with running_worker(tiny_model_dir("qwen3_next"), KEY, **SIGNED) as doomed:
        # no health probe in the test's time: the proxy learns of the death from the copy
        server = await start_proxy(backends=_backends([doomed, workers[1]],
                                                      health_interval_s=600),
                                   route_transfer_min_tokens=64)
        base = f"http://127.0.0.1:{server.port}"
        lead = _body(_conversation_to("w0", "doomed lead", system))
        lead["messages"][0]["content"] = system
        await _ask(http, base + "/v1/chat/completions", lead)
    # w0 is gone (stopped by PID); its index entries are still there until it is noticed
    failed = 'prefixd_route_transfers_total{outcome="error",source="w0",target="w1"}'
    before = await _metric(http, base, failed)
    body = _body(_other_conversation("w0", "doomed", system))
    body["messages"][0]["content"] = system
    got, answer = await _ask(http, base + "/v1/chat/completions", body)
    assert got == "w1" and _cached(answer) == 0
    assert await _metric(http, base, failed) - before == 1


async def test_a_worker_already_getting_the_prefix_gets_it_once(
        workers: list[str], start_proxy: Any, http: aiohttp.ClientSession) -> None:
    """Two new conversations for a worker that lacks their system prompt: the first has it
    copied in; the second, routed while the first is still being served there, does not get a
    second copy (the worker is computing it: prefixes in flight count, on the index's token
    scale) and restores it from the first."""
    server = await start_proxy(backends=_backends(workers), route_transfer_min_tokens=64,
                               route_transfer_timeout_s=120)
    base = f"http://127.0.0.1:{server.port}"
    url = base + "/v1/chat/completions"
    system = SYSTEM.replace("careful", "thrifty")

    def body(user: str) -> dict[str, Any]:
        b = _body(user)
        b["messages"][0]["content"] = system
        return b

    await _ask(http, url, body(_conversation_to("w0", "once lead", system)))   # w0 holds it
    copies = 'prefixd_route_transfers_total{outcome="moved",source="w0",target="w1"}'
    before = await _metric(http, base, copies)
    busy = asyncio.create_task(http.post(      # keeps w1 busy: the first stays in flight
        workers[1] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "tiny", "max_tokens": 600, "messages": [
            {"role": "user", "content": "Count slowly."}]}))
    await asyncio.sleep(0.5)
    first = asyncio.create_task(_ask(http, url, body(_conversation_to("w1", "once a", system))))
    route = server.proxy.router
    for _ in range(2000):                  # it is in flight for some 50 ms: looked for often
        if route.inflight.requests("w1"):
            break
        await asyncio.sleep(0.005)
    assert route.inflight.requests("w1") and not first.done()
    got, second = await _ask(http, url, body(_conversation_to("w1", "once b", system)))
    assert got == "w1" and _cached(second) > 0
    assert (await first)[0] == "w1"
    assert await _metric(http, base, copies) - before == 1
    (await busy).release()


# --- trust: only workers holding one transfer secret move states ---------------------------
async def test_a_worker_of_another_secret_refuses_the_state(
        workers: list[str], tiny_model_dir: Callable[[str], Path], start_proxy: Any,
        http: aiohttp.ClientSession) -> None:
    """The same model, another secret: the target cannot verify the bundle's MAC (403
    `bad_mac`), stores nothing, and the request is served cold."""
    other = {"PREFIXD_TRANSFER_SECRET": "not the secret of the other workers"}
    with running_worker(tiny_model_dir("qwen3_next"), KEY, **other) as outsider:
        server = await start_proxy(backends=_backends([workers[0], outsider]),
                                   route_transfer_min_tokens=64)
        base = f"http://127.0.0.1:{server.port}"
        system = SYSTEM.replace("careful", "guarded")
        lead = _body(_conversation_to("w0", "secret lead", system))
        lead["messages"][0]["content"] = system
        await _ask(http, base + "/v1/chat/completions", lead)
        refused = 'prefixd_route_transfers_total{outcome="refused",source="w0",target="w1"}'
        before = await _metric(http, base, refused)
        body = _body(_other_conversation("w0", "secret", system))
        body["messages"][0]["content"] = system
        got, answer = await _ask(http, base + "/v1/chat/completions", body)
        assert got == "w1" and _cached(answer) == 0
        assert await _metric(http, base, refused) - before == 1
        bad_mac = 'prefixd_worker_cache_imports_total{outcome="bad_mac"}'
        assert await _metric(http, outsider, bad_mac) == 1


async def test_a_worker_without_a_secret_neither_gives_nor_takes_states(
        workers: list[str], tiny_model_dir: Callable[[str], Path], start_proxy: Any,
        http: aiohttp.ClientSession) -> None:
    """An export from a worker with no secret carries no MAC: the proxy does not post it. A
    state sent to it is refused (403 `no_transfer_secret`) before its body is read."""
    with running_worker(tiny_model_dir("qwen3_next"), KEY) as unsigned:
        server = await start_proxy(backends=_backends([unsigned, workers[1]]),
                                   route_transfer_min_tokens=64)
        base = f"http://127.0.0.1:{server.port}"
        system = SYSTEM.replace("careful", "unsigned")
        lead = _body(_conversation_to("w0", "unsigned lead", system))
        lead["messages"][0]["content"] = system
        await _ask(http, base + "/v1/chat/completions", lead)
        imports = "prefixd_worker_cache_imports_total"
        refused = 'prefixd_route_transfers_total{outcome="refused",source="w0",target="w1"}'
        before = await _metric(http, workers[1], imports), await _metric(http, base, refused)
        body = _body(_other_conversation("w0", "unsigned", system))
        body["messages"][0]["content"] = system
        got, answer = await _ask(http, base + "/v1/chat/completions", body)
        assert got == "w1" and _cached(answer) == 0
        assert await _metric(http, base, refused) - before[1] == 1
        assert await _metric(http, workers[1], imports) == before[0]   # nothing was posted
        # the other way: w1 holds a prefix, the unsigned w0 is sent a new conversation
        system = SYSTEM.replace("careful", "unkeyed")
        lead = _body(_conversation_to("w1", "unkeyed lead", system))
        lead["messages"][0]["content"] = system
        await _ask(http, base + "/v1/chat/completions", lead)
        body = _body(_other_conversation("w1", "unkeyed", system))
        body["messages"][0]["content"] = system
        back = 'prefixd_route_transfers_total{outcome="refused",source="w1",target="w0"}'
        before_back = await _metric(http, base, back)
        got, answer = await _ask(http, base + "/v1/chat/completions", body)
        assert got == "w0" and _cached(answer) == 0
        assert await _metric(http, base, back) - before_back == 1
        no_secret = 'prefixd_worker_cache_imports_total{outcome="no_transfer_secret"}'
        assert await _metric(http, unsigned, no_secret) == 1


async def test_managed_workers_of_one_proxy_move_states(
        tiny_model_dir: Callable[[str], Path], start_proxy: Any, http: aiohttp.ClientSession,
        tmp_path: Path) -> None:
    """Two workers the proxy starts get the secret it made for its run: a prefix moves."""
    model = str(tiny_model_dir("qwen3_next"))
    server = await start_proxy(backends=[
        {"name": f"w{i}", "kind": "mlx", "model": model, "models": ["tiny"]} for i in (0, 1)],
        route_transfer_min_tokens=64, use_system_blas=False, cache_dir=tmp_path)
    base = f"http://127.0.0.1:{server.port}"
    system = SYSTEM.replace("careful", "managed")
    lead = _body(_conversation_to("w0", "managed lead", system))
    lead["messages"][0]["content"] = system
    assert (await _ask(http, base + "/v1/chat/completions", lead))[0] == "w0"
    body = _body(_other_conversation("w0", "managed", system))
    body["messages"][0]["content"] = system
    moved = 'prefixd_route_transfers_total{outcome="moved",source="w0",target="w1"}'
    before = await _metric(http, base, moved)
    got, answer = await _ask(http, base + "/v1/chat/completions", body)
    assert got == "w1" and 0 < _cached(answer) < answer["usage"]["prompt_tokens"]
    assert await _metric(http, base, moved) - before == 1


def test_every_worker_of_a_proxy_run_gets_one_secret() -> None:
    """The workers one proxy starts share a secret made for the run (restarts get it again),
    or the setting's, or a backend's own `worker_env`; in the environment, never in argv."""
    config = BackendConfig(name="w", kind="mlx", model="m")
    settings = Settings(_env_file=None, use_system_blas=False)
    first, second = (worker_env(config, settings, token=t)[TRANSFER_SECRET_ENV]
                     for t in ("a", "b"))
    assert first == second == run_transfer_secret() and len(first) >= 32
    assert first not in " ".join(worker_command("m", 1))
    chosen = settings.model_copy(update={"transfer_secret": SecretStr("x" * 20)})
    assert worker_env(config, chosen)[TRANSFER_SECRET_ENV] == "x" * 20
    own = config.model_copy(update={"worker_env": {TRANSFER_SECRET_ENV: "y" * 20}})
    assert worker_env(own, settings)[TRANSFER_SECRET_ENV] == "y" * 20
