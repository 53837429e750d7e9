"""Admission by memory end to end (`scheduler/policy/room.py` through `generation.Generator`),
on the real worker thread and a tiny qwen3_next under a live-cache budget too small for two long
answers: short requests sent while a long answer decodes run beside it and end before it does,
whether the long one takes over half the budget (a decode batch padding a short row to it
would not fit: the short ones decode in passes of their own), more than all of it (alone
only: the short ones borrow the room it leaves now), or holds more than the budget already
with its prompt (the short ones borrow within what it may reach alone); a second long answer
waits; every reply equals the one it gives alone."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.scheduler.jobs import Finished, Job
from prefixd.backends.mlx.scheduler.output import Delta
from prefixd.backends.mlx.scheduler.policy.room import Room
from prefixd.backends.mlx.scheduler.sizing import kv_bytes_per_token, request_bytes
from prefixd.backends.mlx.settings import WorkerSettings
from tests.worker_fixtures import loaded

CACHE = 16 * 2**20
LONG, REPLY, SHORT, SHORT_REPLY, SHORTS = 200, 2000, 20, 8, 3


@pytest.fixture(scope="module")
def gen(tiny_model_dir: Callable[[str], Path]) -> Iterator[Generator]:
    g = Generator(WorkerSettings(_env_file=None, use_system_blas=False, cache_bytes=CACHE,
                                 max_active=8, prefill_slice=64, prefill_slice_ms=0))
    loaded(g, str(tiny_model_dir("qwen3_next")))
    yield g
    g.close()


def _room(gen: Generator) -> Room:
    """The rates the worker charges jobs at (its model's, as `_drive` measures them)."""
    assert gen.loaded is not None
    engine = gen.loaded.engine
    leaves, spec = engine.reference_leaves(), engine.spec
    width = spec.max_draft + 1 if spec else 1
    return Room(0, kv_bytes_per_token(leaves),
                request_bytes(leaves, engine.logits_bytes, width, bool(spec and spec.leaves),
                              engine.batch.ahead.mode != "off"),
                width if spec else 0)


def _budget(gen: Generator, active_bytes: int) -> None:
    gen.settings = gen.settings.model_copy(update={"active_kv_share": active_bytes / CACHE})


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def _submit(gen: Generator, tokens: list[int], max_tokens: int, namespace: str) -> Job:
    return gen.submit(Prompt(tokens, []), Sampling(temperature=0), max_tokens,
                      namespace=namespace)


async def _collect(job: Job, name: str, order: list[str],
                   started: asyncio.Event | None = None) -> str:
    text = []
    async for event in job.events():
        if isinstance(event, Delta):
            text.append(event.text)
            if started is not None:
                started.set()
        elif not isinstance(event, Finished | Delta):
            continue
        else:
            order.append(f"{name}:end")
            assert event.finish_reason == "length", event
            return "".join(text)
    raise AssertionError("no last event")


async def _alone(gen: Generator, tokens: list[int], max_tokens: int) -> str:
    return await _collect(_submit(gen, tokens, max_tokens, "alone"), "alone", [])


LONGS = [_prompt(1, LONG), _prompt(2, LONG)]
SHORT_PROMPTS = [_prompt(10 + i, SHORT) for i in range(SHORTS)]


@pytest.fixture(scope="module")
def alone(gen: Generator) -> tuple[str, list[str]]:
    """The replies the first long prompt and each short one get alone (greedy: the same
    under any budget; taken under the worker's own, before a test sets its small one), once
    for every test: the long one alone is 2000 decode steps."""
    async def replies() -> tuple[str, list[str]]:
        return (await _alone(gen, LONGS[0], REPLY),
                [await _alone(gen, p, SHORT_REPLY) for p in SHORT_PROMPTS])

    with concurrent.futures.ThreadPoolExecutor(1) as pool:   # an event loop of its own
        return pool.submit(asyncio.run, replies()).result()


@pytest.mark.parametrize("share", ["padded", "borrowed", "over"])
async def test_short_requests_run_beside_a_long_answer_under_a_small_budget(
        gen: Generator, alone: tuple[str, list[str]], share: str) -> None:
    room = _room(gen)
    long_cost = room.bytes(LONG + REPLY)
    short_cost = room.bytes(SHORT + SHORT_REPLY)
    # padded: the long answer takes over half the budget, so two of its rows do not fit (nor
    # a short row padded to it, once it is long); borrowed: it takes more than the whole
    # budget (alone only), the short ones fit beside what it holds when they come
    budget = {"padded": long_cost + SHORTS * short_cost + room.bytes(0),
              "borrowed": room.bytes(LONG + 400) + SHORTS * short_cost,
              "over": room.bytes(LONG) // 2}[share]
    assert 2 * long_cost > budget and (share == "padded") == (long_cost < budget)
    assert (share == "over") == (room.bytes(LONG) > budget)
    _budget(gen, budget)
    longs, shorts = LONGS, SHORT_PROMPTS
    alone_long, alone_short = alone

    order: list[str] = []
    started = asyncio.Event()
    first = asyncio.ensure_future(_collect(_submit(gen, longs[0], REPLY, share), "long", order,
                                           started))
    await started.wait()
    second = asyncio.ensure_future(_collect(_submit(gen, longs[1], REPLY, share), "long2",
                                            order))
    got = await asyncio.gather(*(_collect(_submit(gen, p, SHORT_REPLY, share), f"short{i}",
                                          order) for i, p in enumerate(shorts)))
    assert "long:end" not in order       # every short one ended while the long one decoded
    assert await first == alone_long and got == alone_short
    await second
    assert order.index("long:end") < order.index("long2:end")
