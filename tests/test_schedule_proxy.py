"""A managed worker with `max_concurrency` 2 (issue 26, the proxy's side): the proxy sends it
two requests at once and the worker schedules them together, one forward pass at a time, so a
short request sent while a long one runs (a long prompt, then a long answer) is answered
before the long one ends; with 1 it waits behind the whole of it. Each request's log line and
the status page show the time it spent behind others. Requests sharing a long prefix the
worker is computing wait for it and restore it, instead of computing it again beside it."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from tokenizers import Tokenizer

from prefixd.backends.managed import ManagedBackend
from prefixd.backends.supervision.states import ProcState
from prefixd.proxy.server import Server, make_proxy
from prefixd.proxy.settings import Settings

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_a_short_request_is_not_held_behind_a_long_prefill(
        concurrency: int, tiny_model_dir: Callable[[str], Path],
        http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="prefixd.request")
    settings = Settings(_env_file=None, prefix_detect=False, backends=[
        {"name": "w", "kind": "mlx", "model": str(tiny_model_dir("qwen3")), "models": ["t"],
         "max_concurrency": concurrency}])
    backend = ManagedBackend(settings.backends[0], settings)
    server = Server(make_proxy(settings, [backend]))
    await server.start("127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    order: list[str] = []

    tok = Tokenizer.from_file(str(tiny_model_dir("qwen3") / "tokenizer.json"))
    no_end = {str(i): -100 for t in ("<|im_end|>", "<|endoftext|>")
              if (i := tok.token_to_id(t)) is not None}

    async def ask(name: str, text: str, max_tokens: int) -> None:
        body = {"model": "t", "temperature": 0, "max_tokens": max_tokens, "stream": True,
                "logit_bias": no_end, "messages": [{"role": "user", "content": text}]}
        async with http.post(url, json=body) as r:
            assert r.status == 200
            async for line in r.content:
                if b'"content"' in line and b'"role"' not in line:
                    order.append(f"{name}:first")
                    break
            await r.read()
        order.append(f"{name}:end")

    try:
        await backend.wait_for(ProcState.READY, timeout=120)
        long = asyncio.create_task(ask("long", "word " * 3000, 300))   # the window: 4096
        queue = server.proxy.queues["w"]
        for _ in range(500):                     # until the proxy has sent it (deadline)
            if queue.in_flight:
                break
            await asyncio.sleep(0.01)
        await ask("short", "hi", 2)
        await long
        async with http.get(f"http://127.0.0.1:{server.port}/status") as r:
            status = (await r.json())["backends"][0]
    finally:
        await server.shutdown(5.0)
    messages = [r.getMessage() for r in caplog.records if r.name == "prefixd.request"]
    lines = {("long" if int(_field(m, "prompt_tokens")) > 1000 else "short"): m
             for m in messages}
    waited = {k: float(_field(v, "waited_s")) for k, v in lines.items()}
    queued = {k: float(_field(v, "queue_wait_s")) for k, v in lines.items()}
    assert status["waited_n"] == 2
    # the same wait: the status rounds the raw value to 3 decimals, the log line to 4
    assert abs(status["waited_max_s"] - max(waited.values())) <= 0.00051
    if concurrency == 2:
        assert order.index("short:end") < order.index("long:end"), order
        # the long one was paused while the short one's passes ran (in the worker)
        assert waited["long"] > queued["long"]
    else:
        assert order.index("long:end") < order.index("short:first"), order
        assert waited["short"] >= queued["short"] > 0     # behind the long one, in prefixd


def _field(message: str, name: str) -> str:
    found = re.search(rf"\b{name}=(\S+)", message)
    assert found, (name, message)
    return found.group(1)


async def test_requests_sharing_a_long_prefix_wait_for_it_instead_of_computing_it_twice(
        tiny_model_dir: Callable[[str], Path], http: aiohttp.ClientSession) -> None:
    """Sub-agents with one long system prompt sent together: one waits for the other (which
    computes the prefix) and restores it, instead of computing it again beside it."""
    settings = Settings(_env_file=None, prefix_detect=False, backends=[
        {"name": "w", "kind": "mlx", "model": str(tiny_model_dir("qwen3")), "models": ["t"],
         "max_concurrency": 2}])
    backend = ManagedBackend(settings.backends[0], settings)
    server = Server(make_proxy(settings, [backend]))
    await server.start("127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    system = {"role": "system", "content": "rule " * 600}      # ~1,800 tokens

    async def ask(task: str) -> dict:
        body = {"model": "t", "temperature": 0, "max_tokens": 4,
                "messages": [system, {"role": "user", "content": task}]}
        async with http.post(url, json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["usage"]

    try:
        await backend.wait_for(ProcState.READY, timeout=120)
        first = asyncio.create_task(ask("find the bug in parser.py"))
        queue = server.proxy.queues["w"]
        for _ in range(500):                     # until the proxy has sent it (deadline)
            if queue.in_flight:
                break
            await asyncio.sleep(0.01)
        second = await ask("write tests for lexer.py")
        first_usage = await first
        async with http.get(f"http://127.0.0.1:{server.port}/status") as r:
            batch = (await r.json())["backends"][0]["cache"]["batch"]
    finally:
        await server.shutdown(5.0)
    # computed once: whichever the worker started first computes it, the other restores it
    # (both can reach the worker before it starts either: then the shorter goes first)
    cached = sorted(u["prompt_tokens_details"]["cached_tokens"] for u in (first_usage, second))
    assert cached[0] < 256 and cached[1] >= 1500
    # the status page's view of the worker's passes (batched decode)
    assert batch["decode_passes"] > 0 and batch["largest_decode_batch"] >= 1
