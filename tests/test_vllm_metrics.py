"""The worker's /metrics carries the names llm-d's and the Gateway API Inference Extension's
default scorers read (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, `vllm:cache_config_info`), labelled as vLLM labels them, with
prefixd's meaning (`backends/mlx/server/scrape.py`): on a real in-process worker of a tiny
qwen3 taking one job at a time, idle, with a long request under way, and with a second one
waiting behind it; parsed by prometheus_client as a scraper parses them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.server.app import create_app
from prefixd.backends.mlx.settings import WorkerSettings
from tests.worker_fixtures import loaded

NAME = "tiny-vllm-names"
CACHE = 1 << 22            # the prompt cache's budget: 4 MiB
SETTINGS = WorkerSettings(_env_file=None, use_system_blas=False, max_active=1,
                          cache_bytes=CACHE, max_tokens_default=6)
LIVE_BUDGET = SETTINGS.active_kv_share * CACHE
DEADLINE = 120.0   # seconds for the whole of one test's requests


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def worker(model: Path) -> Iterator[Generator]:
    gen = loaded(Generator(SETTINGS), str(model))
    yield gen
    gen.close()


@pytest.fixture
async def client(worker: Generator) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(create_app(worker, NAME, SETTINGS))) as c:
        yield c


def kv_bytes_per_token(model: Path) -> int:
    """Keys and values of every layer, from the model's config (the tiny model computes in
    float32): what one token of its KV weighs."""
    config = json.loads((model / "config.json").read_text())
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] \
        * config["head_dim"] * 4


async def scrape(client: TestClient) -> dict[str, list[Any]]:
    """The worker's /metrics as a scraper reads it: family name -> its samples."""
    resp = await client.get("/metrics")
    assert resp.status == 200
    return {f.name: f.samples for f in text_string_to_metric_families(await resp.text())}


def gauge(families: dict[str, list[Any]], name: str) -> float:
    """The one sample of `name` for this worker, labelled as vLLM labels it (fails if the
    family or its sample is missing)."""
    assert name in families, f"{name} missing from /metrics"
    mine = [s for s in families[name] if s.labels == {"model_name": NAME, "engine": "0"}]
    assert len(mine) == 1, families[name]
    return float(mine[0].value)


def load(families: dict[str, list[Any]]) -> tuple[float, float, float]:
    """(waiting, running, KV usage)."""
    return (gauge(families, "vllm:num_requests_waiting"),
            gauge(families, "vllm:num_requests_running"),
            gauge(families, "vllm:kv_cache_usage_perc"))


async def read_until(resp: ClientResponse, done: Callable[[bytes], bool]) -> None:
    """Read a streamed reply line by line until `done(line)` (the caller's deadline bounds it)."""
    async for line in resp.content:
        if done(line):
            return
    raise AssertionError("the stream ended first")


def generated(line: bytes) -> bool:
    """Whether an SSE line is a delta of generated text (not the opening role chunk)."""
    if not line.startswith(b"data: {"):
        return False
    delta = json.loads(line[6:])["choices"][0]["delta"]
    return "role" not in delta and bool(delta.get("content") or delta.get("reasoning_content"))


def chat(text: str, max_tokens: int) -> dict[str, Any]:
    return {"model": NAME, "messages": [{"role": "user", "content": text}],
            "temperature": 0, "max_tokens": max_tokens, "stream": True}


async def test_an_idle_worker_reports_nothing_under_way_and_its_cache_config(
        client: TestClient, model: Path) -> None:
    families = await scrape(client)
    assert load(families) == (0.0, 0.0, 0.0)
    assert "vllm:cache_config_info" in families, "vllm:cache_config_info missing from /metrics"
    [info] = families["vllm:cache_config_info"]
    assert info.value == 1.0
    # blocks of the KV events' size, as many as the prompt cache's budget holds of this model
    assert info.labels == {"block_size": "16", "engine": "0",
                           "num_gpu_blocks": str(CACHE // (16 * kv_bytes_per_token(model)))}
    assert int(info.labels["num_gpu_blocks"]) > 0


async def test_a_request_under_way_and_one_waiting_behind_it(
        client: TestClient, model: Path) -> None:
    """max_active 1: a long reply runs (running 1, its live cache counted), a second request
    waits behind it (waiting 1, told its place); the long one's client leaves, the second
    runs to its end, and the worker is idle again (0, 0, nothing live)."""
    long = chat("Tell me everything about rivers.", 4000)   # ends in seconds at best
    tokens = await (await client.post("/tokenize", json=long)).json()
    async with asyncio.timeout(DEADLINE):
        first = await client.post("/v1/chat/completions", json=long)
        assert first.status == 200
        await read_until(first, generated)
        waiting, running, usage = load(await scrape(client))
        assert (waiting, running) == (0, 1)
        # its live cache holds its prompt at least, and stays within the live budget
        assert len(tokens["tokens"]) * kv_bytes_per_token(model) / LIVE_BUDGET <= usage <= 1

        second = await client.post("/v1/chat/completions", json=chat("And lakes?", 4))
        assert second.status == 200
        await read_until(second, lambda line: line.startswith(b": queued position=1"))
        waiting, running, usage = load(await scrape(client))
        assert (waiting, running) == (1, 1) and 0 < usage <= 1

        first.close()     # its client left: the long reply stops, the second one runs
        await read_until(second, lambda line: line.strip() == b"data: [DONE]")
        assert load(await scrape(client)) == (0.0, 0.0, 0.0)


async def test_a_loading_worker_reports_no_load_and_no_cache_config_yet() -> None:
    gen = Generator(SETTINGS)
    try:
        async with TestClient(TestServer(create_app(gen, NAME, SETTINGS))) as c:
            families = await scrape(c)
            assert load(families) == (0.0, 0.0, 0.0)
            assert not families.get("vllm:cache_config_info")   # its blocks are not known yet
    finally:
        gen.close()
