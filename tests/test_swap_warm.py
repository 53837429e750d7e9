"""Issue 16's swap path with real workers: two tiny models under a model budget that fits one,
conversations alternating between them through prefixd. At no moment are two workers loaded;
every turn after a swap is served from the swapped-out worker's disk tier (its cached tokens
cover the conversation's previous turn) with the answer a cold worker gives.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from test_worker_e2e import START_TIMEOUT_S, UNFED_TAIL, start_worker

from prefixd.backends.managed import ManagedBackend
from prefixd.proxy.server import Server, make_proxy
from prefixd.proxy.settings import Settings

CACHE = 512 * 2**20          # each worker's RAM cache budget: its measured footprint dominates
BUDGET = 900 * 2**20         # fits one worker (~130 MiB process + 512 MiB cache), not two


async def _ask(http: aiohttp.ClientSession, url: str, model: str,
               messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 8}
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_alternating_models_swap_and_stay_warm(tiny_model_dir: Callable[[str], Path],
                                                     tmp_path: Path,
                                                     http: aiohttp.ClientSession) -> None:
    models = {"hyb": tiny_model_dir("qwen3_next"), "swa": tiny_model_dir("gemma3_text")}
    settings = Settings(_env_file=None, model_memory_bytes=BUDGET, cache_dir=tmp_path,
                        disk_cache_bytes=2**30, use_system_blas=False, backends=[
                            {"name": n, "kind": "mlx", "model": str(p), "models": [n],
                             "cache_bytes": CACHE, "startup_probe_max_s": 0.05}
                            for n, p in models.items()])
    managed = [ManagedBackend(c, settings) for c in settings.backends]
    server = Server(make_proxy(settings, managed))
    await server.start("127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}"
    cold = {n: start_worker(p, PREFIXD_CACHE_BYTES="0", PREFIXD_DISK_CACHE_BYTES="0",
                            PREFIXD_USE_SYSTEM_BLAS="false") for n, p in models.items()}
    most_loaded = 0

    async def watch() -> None:              # an observer of the pool, sampled every 20 ms
        nonlocal most_loaded
        while True:
            most_loaded = max(most_loaded, sum(b.loaded for b in managed))
            await asyncio.sleep(0.02)

    async def cold_ask(name: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
        if name not in up:          # the cold ones start while the pool loads its first
            await asyncio.to_thread(cold[name].log.wait_for, "worker: serving",
                                    START_TIMEOUT_S)
            up.add(name)
        return await _ask(http, cold[name].url, "tiny", messages)

    up: set[str] = set()
    watcher = asyncio.create_task(watch())
    try:
        convs = {n: [{"role": "system", "content": f"You are the {n} model. " * 20},
                     {"role": "user", "content": "Tell me about the river."}] for n in models}
        previous: dict[str, int] = {}
        for turn in range(3):
            for name in models:
                # the cold worker's answer is asked for while the pool swaps its model in
                got, ref = await asyncio.gather(_ask(http, url, name, convs[name]),
                                                cold_ask(name, convs[name]))
                assert got["choices"][0]["message"]["content"] == \
                    ref["choices"][0]["message"]["content"]
                cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
                if name in previous:                 # the other model ran in between
                    assert cached >= previous[name] - UNFED_TAIL, (turn, name, got["usage"])
                previous[name] = got["usage"]["prompt_tokens"] + \
                    got["usage"]["completion_tokens"]
                convs[name] += [{"role": "assistant",
                                 "content": got["choices"][0]["message"]["content"]},
                                {"role": "user", "content": f"Turn {turn + 2}: and the sea?"}]
        assert most_loaded == 1
        async with http.get(url + "/status") as r:
            loaded = [b for b in (await r.json())["backends"] if b.get("cache")]
        assert [b["cache"]["disk"]["records"] > 0 for b in loaded] == [True]   # the page's view
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        unloads = [line for line in text.splitlines()
                   if line.startswith("prefixd_model_unloads_total") and 'reason="budget"' in line]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in unloads) >= 4
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await server.shutdown(30)
        for w in cold.values():
            w.stop()
