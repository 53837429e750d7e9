"""The in-process mlx worker of the worker tests: a tiny real qwen3 model behind the real app
on a loopback server (fixtures `generator`, `client`; star-imported by tests/conftest.py, one
model load per test module that uses them), and the request helpers the tests import."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.scheduler.jobs import Finished, Job, Queued
from prefixd.backends.mlx.scheduler.output import Delta
from prefixd.backends.mlx.server.app import create_app
from prefixd.backends.mlx.settings import WorkerSettings
from prefixd.proxy.settings import Settings

__all__ = ["client", "generator"]


def loaded(gen: Generator, model: str) -> Generator:
    """`gen` with `model` loaded by the worker's own `Generator.load` (on an event loop of its
    own, in a thread: callable from a sync fixture or an async test alike)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, gen.load(model)).result()
    return gen

def batching(path: Path, **extra: Any) -> Generator:
    """A worker's generator on `path` that runs up to 8 jobs at once (their decode steps in one
    pass), prefill slices unbounded, a checkpoint every 64 tokens."""
    return loaded(Generator(WorkerSettings(_env_file=None, use_system_blas=False, max_active=8,
                                           prefill_slice_ms=0, checkpoint_interval=64,
                                           **extra)), str(path))


def untimed(path: Path, **extra: Any) -> Generator:
    """A worker's generator on `path` whose drafts are sized by the prior costs (as a group's
    are), never by time: what gets drafted, and in which batches, is the same on any machine."""
    gen = loaded(Generator(WorkerSettings(_env_file=None, use_system_blas=False,
                                          prefill_slice_ms=0, **extra)), str(path))
    if gen.loaded is not None and gen.loaded.engine.spec is not None:
        gen.loaded.engine.spec.costs.timed = False
    return gen


def on_and_off(path: Path) -> Iterator[tuple[Generator, Generator]]:
    """Two `untimed` generators on `path`, speculating and not (a fixture's body)."""
    on, off = untimed(path), untimed(path, speculative=False)
    yield on, off
    on.close()
    off.close()


SETTINGS = Settings(_env_file=None, max_tokens_default=6, use_system_blas=False)
NAME = "tiny-qwen3"
HELLO = [{"role": "system", "content": "You are a cache."},
         {"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def generator(tiny_model_dir: Callable[[str], Path]) -> Iterator[Generator]:
    gen = loaded(Generator(SETTINGS), str(tiny_model_dir("qwen3")))
    yield gen
    gen.close()


@pytest.fixture
async def client(generator: Generator) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(create_app(generator, NAME, SETTINGS))) as c:
        yield c


async def collect(job: Job, cancel_after: int | None = None
                  ) -> tuple[str, list[float], Finished]:
    """A generation job's text, the log-probability of each token and its end (cancelled
    once `cancel_after` tokens came, if set); a queue position is skipped, anything else
    fails."""
    text: list[str] = []
    logprobs: list[float] = []
    async for event in job.events():
        if isinstance(event, Delta):
            text.append(event.text)
            logprobs.extend(t.logprob for t in event.logprobs)
            if cancel_after is not None and len(logprobs) >= cancel_after:
                job.cancel()
        elif isinstance(event, Finished):
            return "".join(text), logprobs, event
        elif not isinstance(event, Queued):
            raise AssertionError(event)
    raise AssertionError("no last event")


def chat(messages: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"model": NAME, "messages": messages or HELLO, "temperature": 0, **extra}


async def post(client: TestClient, body: dict[str, Any], path: str = "/v1/chat/completions"
               ) -> dict[str, Any]:
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def stream(client: TestClient, body: dict[str, Any], path: str = "/v1/chat/completions"
                 ) -> list[Any]:
    """Every SSE `data:` payload, parsed (`[DONE]` stays a string)."""
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            events.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return events


def streamed_text(events: list[Any]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1] if e["choices"])


async def post_get(client: TestClient, path: str) -> Any:
    resp = await client.get(path)
    assert resp.status == 200
    return await resp.json()
