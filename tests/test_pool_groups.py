"""A group beside a single worker under one memory budget (issue 47), with real processes:
one worker and a two-rank group (loopback, tensor parallel) of the same tiny model, under the
8 GB model budget of the outside check that found them unloading each other on every request.
Both together hold a few hundred MB and their cache shares fit them together: requests
alternating between them unload neither."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import aiohttp
import psutil
import pytest

from prefixd.backends.budget import measured_footprint
from prefixd.backends.managed import ManagedBackend
from prefixd.metrics import proxy as m
from prefixd.proxy.server import Server, make_proxy
from prefixd.proxy.settings import Settings

pytestmark = pytest.mark.slow
BUDGET = 8_000_000_000


async def test_a_group_and_a_single_worker_stay_loaded_together(
        tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model = str(tiny_model_dir("qwen3"))
    settings = Settings(_env_file=None, prefix_detect=False, model_memory_bytes=BUDGET,
                        cache_dir=tmp_path, backends=[
        {"name": "one", "kind": "mlx", "model": model, "models": ["one"]},
        {"name": "pair", "kind": "mlx", "model": model, "models": ["pair"],
         "hosts": ["127.0.0.1", "127.0.0.1"], "parallel": "tensor"}])
    backends = [ManagedBackend(c, settings, stop_grace_s=10.0) for c in settings.backends]
    unloads = [m.MODEL_UNLOADS.labels(b.name, r)._value.get()
               for b in backends for r in ("budget", "group")]
    server = Server(make_proxy(settings, backends))
    await server.start("127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
            for name in ("one", "pair", "one", "pair"):
                body = {"model": name, "max_tokens": 3, "temperature": 0,
                        "messages": [{"role": "user", "content": "hello"}]}
                async with http.post(base + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                assert all(b.loaded for b in backends), name      # neither was unloaded
            infos = [await b.cache_info() for b in backends]
            async with http.get(base + "/status") as r:
                memory = (await r.json())["model_memory"]
    finally:
        await server.shutdown(20.0)
    assert psutil.Process().children(recursive=True) == []
    assert [m.MODEL_UNLOADS.labels(b.name, r)._value.get()
            for b in backends for r in ("budget", "group")] == unloads
    assert memory["loaded"] == ["one", "pair"] and memory["loaded_bytes"] <= BUDGET
    # what the pool planned with is what the workers measure: the group's two ranks, each
    # its process and its cache's room
    assert sum(measured_footprint(i) or 0 for i in infos) <= BUDGET
    ranks = infos[1]["group"]["ranks"]
    assert len(ranks) == 2 and all(r["memory"]["rss_bytes"] > 0 for r in ranks)
