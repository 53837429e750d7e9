"""The whole real path: the proxy in front of a managed worker (real `prefixd worker` process)
on a tiny hybrid model. The worker's cache metrics reach the proxy's /metrics, and a prompt
mutation is reported at an exact token offset (the worker's /tokenize)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from prefixd.backends.managed import ManagedBackend
from prefixd.backends.supervision.states import ProcState
from prefixd.metrics.federate import label_worker_metrics
from prefixd.proxy.server import Server, make_proxy
from prefixd.proxy.settings import Settings

WORKER_TEXT = """# HELP prefixd_worker_cached_tokens_total Prompt tokens restored.
# TYPE prefixd_worker_cached_tokens_total counter
prefixd_worker_cached_tokens_total 12.0
# HELP prefixd_worker_cache_bytes Bytes held.
# TYPE prefixd_worker_cache_bytes gauge
prefixd_worker_cache_bytes{kind="kv"} 100.0
# HELP prefixd_process_cpu_seconds_total CPU.
# TYPE prefixd_process_cpu_seconds_total counter
prefixd_process_cpu_seconds_total 1.0
"""


def test_worker_metrics_are_labelled_and_grouped():
    text = label_worker_metrics({"a": WORKER_TEXT, "b": WORKER_TEXT.replace("12.0", "30.0")})
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(fams) == {"prefixd_worker_cached_tokens", "prefixd_worker_cache_bytes"}
    values = {s.labels["backend"]: s.value for s in fams["prefixd_worker_cached_tokens"].samples}
    assert values == {"a": 12.0, "b": 30.0}
    assert fams["prefixd_worker_cache_bytes"].samples[0].labels == {"backend": "a", "kind": "kv"}


async def test_proxy_over_real_worker(tiny_model_dir: Callable[[str], Path],
                                      http: aiohttp.ClientSession) -> None:
    model = tiny_model_dir("qwen3_next")
    settings = Settings(_env_file=None, backends=[
        {"name": "tiny", "kind": "mlx", "model": str(model), "models": ["tiny"]}])
    managed = ManagedBackend(settings.backends[0], settings)
    server = Server(make_proxy(settings, [managed]))
    await server.start("127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.port}"
    try:
        await managed.wait_for(ProcState.READY, timeout=120)
        system = "You are a helpful agent. The time is 10:41:03 now. " + "Be brief. " * 40
        first = {"model": "tiny", "max_tokens": 4, "temperature": 0, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "hello there"}]}
        async with http.post(base + "/v1/chat/completions", json=first) as r:
            assert r.status == 200
        second = {**first, "messages": [{"role": "system",
                                         "content": system.replace("10:41:03", "10:41:44")},
                                        first["messages"][1]]}
        async with http.post(base + "/v1/chat/completions", json=second) as r:
            assert r.status == 200
            header = r.headers["X-Prefixd-Prefix"]
            usage = (await r.json())["usage"]
        assert "verdict=MUTATED" in header and "clock_time" in header
        at = header.split("at=")[1].split(";")[0]
        assert at.startswith("system[0]+") and "@~" not in at   # exact, from /tokenize
        reused = int(header.split("reused=")[1].split("/")[0])
        # what the worker reused is bounded by where the prompt changed
        assert usage["prompt_tokens_details"]["cached_tokens"] <= reused
        # the worker's per-turn breakdown reaches the proxy's report of that turn
        async with http.get(base + "/debug/prefix") as r:
            lane = (await r.json())["lanes"][0]["lane"]
        async with http.get(base + f"/debug/prefix/{lane}") as r:
            report = (await r.json())["reports"][-1]
        timings = report["backend_breakdown"]["timings_ms"]
        assert timings["prefill"] > 0 and "checkpoint" in timings
        async with http.get(base + "/metrics") as r:
            fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
        cached = fams["prefixd_worker_recomputed_tokens"].samples
        assert any(s.labels.get("backend") == "tiny" and s.value > 0 for s in cached)
    finally:
        await server.shutdown(1.0)


async def test_status_shows_the_workers_cache(tiny_model_dir: Callable[[str], Path],
                                              http: aiohttp.ClientSession) -> None:
    settings = Settings(_env_file=None, backends=[
        {"name": "tiny", "kind": "mlx", "model": str(tiny_model_dir("qwen3")),
         "models": ["tiny"], "cache_bytes": 50_000_000}])
    managed = ManagedBackend(settings.backends[0], settings)
    server = Server(make_proxy(settings, [managed]))
    await server.start("127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.port}"
    try:
        await managed.wait_for(ProcState.READY, timeout=120)
        async with http.post(base + "/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 2,
                "messages": [{"role": "user", "content": "hello " * 20}]}) as r:
            assert r.status == 200
        async with http.get(base + "/status") as r:
            status = (await r.json())["backends"][0]
        cache = status["cache"]
        assert cache["budget"] == 50_000_000 and cache["entries"] == 1
        assert 0 < cache["bytes_used"] <= cache["budget"]
        # the worker reports its memory, and the pool counts it as the model's footprint
        memory = (await managed.cache_info() or {})["memory"]
        assert memory["rss_bytes"] > 0 and memory["mlx_active_bytes"] > 0
        assert memory["mlx_peak_bytes"] >= memory["mlx_active_bytes"]
        assert status["footprint_source"] == "measured"
        room = cache["budget"] - cache["bytes_used"]
        assert room < status["footprint_bytes"] <= room + 2 * memory["rss_bytes"]
    finally:
        await server.shutdown(1.0)
