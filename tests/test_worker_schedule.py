"""The worker's scheduler end to end (`schedule.py` through `generation.Generator`), on the real
in-process worker thread and a tiny qwen3: with max_active 2, a short request submitted behind
a long prefill ends before the long one's first token, with the outputs a serial run gives;
with max_active 1, it waits (today's order); a job cancelled mid-prefill ends promptly."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prefixd.backends.mlx.chat import Sampling
from prefixd.backends.mlx.generation import Generator
from prefixd.backends.mlx.jobs import Finished, Job
from prefixd.backends.mlx.output import Delta
from prefixd.backends.mlx.prompt import Prompt
from prefixd.backends.mlx.settings import WorkerSettings

LONG, SHORT = 3000, 12


def _settings(max_active: int) -> WorkerSettings:
    return WorkerSettings(_env_file=None, max_tokens_default=6, use_system_blas=False,
                          max_active=max_active, prefill_slice=64, checkpoint_interval=256)


@pytest.fixture(scope="module", params=[1, 2])
def gen(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]
        ) -> Iterator[Generator]:
    g = Generator(_settings(request.param))
    g.load_blocking(str(tiny_model_dir("qwen3")))
    yield g
    g.close()


def _prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(26)
    return ([rng.randrange(1, 1000) for _ in range(LONG)],
            [rng.randrange(1, 1000) for _ in range(SHORT)])


def _submit(gen: Generator, tokens: list[int], namespace: str) -> Job:
    return gen.submit(Prompt(tokens, []), Sampling(temperature=0), 6, namespace=namespace)


async def _collect(job: Job, name: str, order: list[str]) -> tuple[str, Finished]:
    text = []
    async for event in job.events():
        if isinstance(event, Delta):
            order.append(f"{name}:delta")
            text.append(event.text)
        else:
            order.append(f"{name}:end")
            assert isinstance(event, Finished), event
            return "".join(text), event
    raise AssertionError("no last event")


async def test_a_short_request_does_not_wait_behind_a_long_prefill(gen: Generator) -> None:
    import asyncio

    long, short = _prompts()
    order: list[str] = []
    serial_long = await _collect(_submit(gen, long, "serial"), "x", [])
    serial_short = await _collect(_submit(gen, short, "serial"), "x", [])
    jobs = [_submit(gen, long, "together"), _submit(gen, short, "together")]
    got_long, got_short = await asyncio.gather(_collect(jobs[0], "long", order),
                                               _collect(jobs[1], "short", order))
    assert (got_long[0], got_short[0]) == (serial_long[0], serial_short[0])
    assert got_long[1].cached_tokens == got_short[1].cached_tokens == 0
    if gen.settings.max_active == 1:      # today's order: the short one waits
        assert order.index("long:end") < order.index("short:delta")
    else:                                 # it ends before the long prefill does
        assert order.index("short:end") < order.index("long:delta")


async def test_a_cancelled_prefill_ends_within_a_slice(gen: Generator) -> None:
    import asyncio

    long, short = _prompts()
    order: list[str] = []
    job = _submit(gen, [7, *long], "cancel")
    other = _submit(gen, [7, *short], "cancel")
    waiter = asyncio.ensure_future(_collect(job, "long", order))
    await _collect(other, "short", order)
    job.cancel()
    text, end = await waiter
    if gen.settings.max_active == 2:
        assert end.finish_reason == "cancelled" and text == ""
    assert not gen._pending
