"""The worker's scheduler end to end (`schedule.py` through `generation.Generator`), on the real
in-process worker thread and a tiny qwen3: with max_active 2, a short request submitted behind
a long prefill ends before the long one's first token, with the outputs a serial run gives;
with max_active 1, it waits (today's order); a job cancelled mid-prefill ends promptly; a job
that waits for room is told its place in line."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.scheduler.jobs import Finished, Job, Queued
from prefixd.backends.mlx.scheduler.output import Delta
from prefixd.backends.mlx.settings import WorkerSettings
from tests.worker_fixtures import loaded

LONG, SHORT = 3000, 12


def _settings(max_active: int) -> WorkerSettings:
    return WorkerSettings(_env_file=None, max_tokens_default=6, use_system_blas=False,
                          max_active=max_active, prefill_slice=64, prefill_slice_ms=0,
                          checkpoint_interval=256)


@pytest.fixture(scope="module", params=[1, 2])
def gen(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]
        ) -> Iterator[Generator]:
    g = Generator(_settings(request.param))
    loaded(g, str(tiny_model_dir("qwen3")))
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
        if isinstance(event, Queued):
            order.append(f"{name}:queued={event.position}")
        elif isinstance(event, Delta):
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


async def test_seeded_sampling_draws_the_same_tokens_interleaved(gen: Generator) -> None:
    """Two seeded requests decoding together draw what each draws alone (each has its own
    random key; MLX's global state would interleave their draws)."""
    import asyncio

    rng = random.Random(5)
    prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in (20, 30)]

    def sampled(tokens: list[int], namespace: str) -> Job:
        return gen.submit(Prompt(tokens, []), Sampling(temperature=1.5, seed=1234), 12,
                          namespace=namespace)

    alone = [(await _collect(sampled(p, "seed-alone"), "x", []))[0] for p in prompts]
    together = await asyncio.gather(*(_collect(sampled(p, "seed-together"), f"j{i}", [])
                                      for i, p in enumerate(prompts)))
    assert [t for t, _ in together] == alone
    assert alone[0] and alone[1]


async def test_time_behind_others_is_reported(gen: Generator) -> None:
    """`queue` (waiting to start) and `paused` (started, while others' passes ran): with 2
    active the long job is paused at least for the short one's own passes; serial, the short
    one queues at least for the long one's prefill."""
    import asyncio

    long, short = _prompts()
    jobs = [_submit(gen, [9, *long], "behind"), _submit(gen, [9, *short], "behind")]
    (_, lend), (_, send) = await asyncio.gather(_collect(jobs[0], "long", []),
                                                _collect(jobs[1], "short", []))
    assert lend.prefixd is not None and send.prefixd is not None
    lt, st = lend.prefixd["timings_ms"], send.prefixd["timings_ms"]
    if gen.settings.max_active == 2:
        assert lt["paused"] >= st["prefill"] + st["first_token"] > 0
    else:
        assert lt["paused"] == st["paused"] == 0
        assert st["queue"] >= lt["prefill"] > 0


async def test_a_state_call_runs_between_passes(gen: Generator) -> None:
    """An export or import (`Generator.call`) does not wait for a running job to end: it runs
    between two of its passes, with one job at a time too (one scheduling path: before, with
    max_active 1 a call waited for the whole job)."""
    import asyncio

    long, _ = _prompts()
    job = _submit(gen, [11, *long], "call")
    waiter = asyncio.ensure_future(_collect(job, "long", []))
    under_way = await gen.call(lambda engine: job in gen._pending)   # on the thread
    _, end = await waiter
    assert under_way and end.finish_reason == "length"


async def test_a_job_waiting_for_room_is_told_its_place(
        tiny_model_dir: Callable[[str], Path]) -> None:
    """With no room for a second live cache (active_kv_share tiny: each job alone passes the
    budget, and none is short enough to borrow room beside another as long), jobs wait to be
    admitted one after another, each told its place in line as it moves up, before any
    output."""
    import asyncio

    g = Generator(_settings(3).model_copy(update={"active_kv_share": 1e-12}))
    loaded(g, str(tiny_model_dir("qwen3")))
    try:
        long, _ = _prompts()
        orders: list[list[str]] = [[], [], []]
        jobs = [_submit(g, [13, *long], "room"), _submit(g, [14, *long], "room"),
                _submit(g, [15, *long], "room")]
        ends = await asyncio.gather(*(_collect(j, "j", o) for j, o in zip(jobs, orders,
                                                                            strict=True)))
        assert [e.finish_reason for _, e in ends] == ["length"] * 3
        assert orders[0][0] == "j:delta"                           # admitted at once
        assert orders[1][:2] == ["j:queued=1", "j:delta"]
        assert orders[2][:3] == ["j:queued=2", "j:queued=1", "j:delta"]
    finally:
        g.close()
