"""Decode passes launched ahead (`engine/batch/launch.py`) on the real worker thread and the five
tiny architectures: greedy requests decoding together (no log-probabilities asked: each draw
is the argmax) launch each next pass before the last one's tokens are read. Their replies equal
each one's alone, and every change of the batch takes the launched pass back exactly: members
ending at different lengths, newcomers riding in, a member cancelled, a stop string; the
states they commit give the next turn what a cold run gives. A model with sliding windows
never launches (a window cannot go back)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models.cache import RotatingKVCache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.model.tiny import ARCHS
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.scheduler.jobs import Delta, Finished, Queued
from tests.worker_fixtures import batching

Reply = tuple[str, int, str]    # text, completion tokens, finish reason


@pytest.fixture(scope="module", params=ARCHS)
def gen(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]
        ) -> Iterator[Generator]:
    """Speculation on (the default): a step where a draft is offered launches nothing."""
    g = batching(tiny_model_dir(request.param), decode_ahead="on")
    yield g
    g.close()


@pytest.fixture(scope="module", params=ARCHS)
def plain(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]
          ) -> Iterator[Generator]:
    """Speculation off: every plain step of a batch may launch the next."""
    g = batching(tiny_model_dir(request.param), speculative=False, decode_ahead="on")
    yield g
    g.close()


def _windowed(gen: Generator) -> bool:
    assert gen.loaded is not None
    return any(isinstance(leaf, RotatingKVCache)
               for leaf in snapshot.leaves(gen.loaded.engine.fresh_cache()))


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(n)] for n in lengths]


def _ahead(gen: Generator) -> tuple[int, int]:
    assert gen.loaded is not None
    batch = gen.loaded.engine.cache_info()["batch"]
    return batch["passes_launched_ahead"], batch["passes_launched_ahead_undone"]


async def _ask(gen: Generator, prompt: list[int], max_tokens: int, namespace: str,
               stop: tuple[str, ...] = (), cancel_after: int | None = None,
               started: asyncio.Event | None = None) -> Reply:
    """A greedy request without log-probabilities (its draw is the argmax)."""
    job = gen.submit(Prompt(prompt, []), Sampling(temperature=0, stop=stop), max_tokens,
                     namespace=namespace)
    text: list[str] = []
    async for event in job.events():
        if isinstance(event, Delta):
            text.append(event.text)
            if started is not None:
                started.set()
            if cancel_after is not None and len(text) >= cancel_after:
                job.cancel()
        elif isinstance(event, Finished):
            return "".join(text), event.completion_tokens, event.finish_reason
        elif not isinstance(event, Queued):
            raise AssertionError(f"unexpected event {event!r}")
    raise AssertionError("no Finished event")


def _held(gen: Generator, prompt: list[int], namespace: str) -> list[int]:
    """The conversation as the worker holds it now (its longest entry past the prompt)."""
    assert gen.loaded is not None
    return max((e.tokens for e in gen.loaded.engine.store.entries
                if e.namespace == namespace and e.tokens[:len(prompt)] == prompt), key=len)


async def _warm_equals_cold(gen: Generator, prompts: list[list[int]], namespace: str) -> None:
    """Each held conversation and a few new tokens, restored, equals a cold run of it."""
    rng = random.Random(len(namespace))
    for p in prompts:
        held = _held(gen, p, namespace)
        follow = [*held, *(rng.randrange(1, 1000) for _ in range(5))]
        assert await _ask(gen, follow, 8, namespace) == await _ask(gen, follow, 8,
                                                                   namespace + "-cold")


async def test_greedy_requests_launch_their_next_pass_ahead_and_reply_as_alone(
        plain: Generator) -> None:
    """Four greedy requests ending at four different steps: the passes between are launched
    ahead (none on a windowed model), an end takes back at most one, and every reply is its
    reply alone."""
    gen = plain
    prompts = _prompts(21, (9, 40, 75, 130))
    budgets = (20, 9, 30, 14)
    alone = [await _ask(gen, p, n, "ahead-alone") for p, n in zip(prompts, budgets, strict=True)]
    used0, undone0 = _ahead(gen)
    together = await asyncio.gather(*(_ask(gen, p, n, "ahead")
                                      for p, n in zip(prompts, budgets, strict=True)))
    used, undone = _ahead(gen)
    assert list(together) == alone
    assert [n for _, n, _ in together] == list(budgets)
    if _windowed(gen):
        assert (used, undone) == (used0, undone0)
    else:   # 30 steps: the riders' and the first, the ends' and the last alone launch none
        assert used - used0 >= 12
        assert undone - undone0 <= 3      # at most one an end (the last one ends alone)
    await _warm_equals_cold(gen, prompts, "ahead")


async def test_with_speculation_on_launched_and_verified_passes_reply_as_alone(
        gen: Generator) -> None:
    """Speculation on (drafts verified in some steps, passes launched in others): every
    reply is its reply alone, and the next turn equals cold."""
    prompts = _prompts(22, (12, 48, 90))
    alone = [await _ask(gen, p, 36, "spec-alone") for p in prompts]
    together = await asyncio.gather(*(_ask(gen, p, 36, "spec") for p in prompts))
    assert list(together) == alone
    await _warm_equals_cold(gen, prompts, "spec")


async def test_newcomers_and_a_cancel_take_the_launched_pass_back_exactly(
        plain: Generator) -> None:
    """Requests arriving while two decode (their last prompt token rides in the next pass)
    and one cancelled mid-reply: each change takes the launched pass back, and every reply
    that ran to its end equals its reply alone."""
    gen = plain
    first = _prompts(31, (33, 70))
    later = _prompts(32, (18, 52))
    alone = [await _ask(gen, p, 40, "join-alone") for p in first + later]
    used0, undone0 = _ahead(gen)
    started = asyncio.Event()
    running = [asyncio.create_task(_ask(gen, first[0], 40, "join", started=started)),
               asyncio.create_task(_ask(gen, first[1], 40, "join", cancel_after=12))]
    await asyncio.wait_for(started.wait(), 60)
    await asyncio.sleep(0.05)          # a few steps of the two (launched ahead), then more come
    joining = [asyncio.create_task(_ask(gen, p, 40, "join")) for p in later]
    got = await asyncio.gather(*running, *joining)
    used, undone = _ahead(gen)
    assert got[1][2] == "cancelled" and 12 <= got[1][1] < 40
    assert [got[0], got[2], got[3]] == [alone[0], alone[2], alone[3]]
    if not _windowed(gen):
        assert used > used0 and undone > undone0
    await _warm_equals_cold(gen, [first[0], *later], "join")


async def test_a_stop_string_in_company_ends_as_alone_and_its_next_turn_is_warm(
        plain: Generator) -> None:
    """A reply ended by a stop string beside others decoding (the launched pass is taken back
    before its state is stored) ends where it ends alone; its next turn equals cold."""
    gen = plain
    prompts = _prompts(41, (25, 60, 47))
    text, _, _ = await _ask(gen, prompts[0], 30, "stop-probe")
    stop = next((text[i:i + 3] for i in range(len(text) // 2, len(text) - 3)
                 if text[i:i + 3].strip() and text[i:i + 3] not in text[:i]), None)
    assert stop is not None, text
    alone = [await _ask(gen, p, 30, "stop-alone", stop=(stop,) if i == 0 else ())
             for i, p in enumerate(prompts)]
    assert alone[0][2] == "stop"
    undone0 = _ahead(gen)[1]
    together = await asyncio.gather(*(_ask(gen, p, 30, "stop", stop=(stop,) if i == 0 else ())
                                      for i, p in enumerate(prompts)))
    assert list(together) == alone
    if not _windowed(gen):
        assert _ahead(gen)[1] > undone0
    await _warm_equals_cold(gen, prompts, "stop")


def test_a_cache_with_a_window_never_launches_and_plain_caches_do() -> None:
    """`may_launch` (pure over the cache kinds and the rows): windows cannot go back."""
    from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache

    from prefixd.backends.mlx.engine.batch.launch import may_launch

    class Row:
        spec = None
        max_tokens, sampled = 10, 1

    rows: list[Any] = [Row(), Row()]
    kv = [BatchKVCache([0, 0])]
    assert may_launch(kv, rows, [True, True])
    assert not may_launch(kv, rows, [True, False])               # a sampled row
    assert not may_launch(kv, rows[:1], [True])                  # one row: no batch
    assert not may_launch([*kv, BatchRotatingKVCache(8, [0, 0])], rows, [True, True])
    assert may_launch([*kv, ArraysCache(2)], rows, [True, True])
    padded = ArraysCache(2, left_padding=[1, 0])     # rows padded: not taken back row by row
    assert not may_launch([*kv, padded], rows, [True, True])

    class Mamba(ArraysCache):   # another class: `undo` would not know it
        pass

    assert not may_launch([*kv, Mamba(2)], rows, [True, True])
    last = Row()
    last.sampled = 8      # it yields its 9th token after this pass, and feeds it: launched
    assert may_launch(kv, [rows[0], last], [True, True])
    last.sampled = 9      # it yields its 10th and last after this pass: nothing to feed
    assert not may_launch(kv, [rows[0], last], [True, True])     # it would be taken back


def test_launching_ahead_pays_where_the_overlap_beats_the_passes_taken_back() -> None:
    """`Worth` (pure): a small model's pass (2 ms, 0.5 ms between steps) launches; a large
    one's on a CPU (65 ms, 2 ms between) launches only at its probes, once a pass in ten
    is taken back; in one of a hundred it pays again. "on" and "off" do as they say."""
    from prefixd.backends.mlx.engine.batch.launch import Worth

    small = Worth()
    assert small.pays()                      # nothing measured yet: launch, and learn
    small.gap(0.0005)
    small.passed(0.002)
    assert small.undone == 0.1 and all(small.pays() for _ in range(40))
    large = Worth()
    large.gap(0.002)
    large.passed(0.065)
    decided = [large.pays() for _ in range(64)]
    assert sum(decided) == 4 and decided[15] and decided[31]   # every 16th chance: a probe
    for _ in range(50):                     # its launched passes all used from now on
        large.outcome(True)
    assert large.undone < 0.01 and large.pays()
    assert all(Worth("on").pays() for _ in range(20))
    assert not any(Worth("off").pays() for _ in range(20))


def test_a_batch_launches_its_next_pass_unless_its_next_step_would_verify() -> None:
    """Whether the next step verifies is the batch's width (`company.width`), not whether some
    member has a draft to offer: one member's short copy on the prior's acceptance beside
    three with nothing is a draft the batch would decline, so its next pass is launched;
    four members copying a long match, or one probing after its wait, would verify. Asking
    changes no member's pace."""
    from prefixd.backends.mlx.engine.batch.executor import Batch
    from prefixd.backends.mlx.engine.batch.passes import PassCounts
    from prefixd.backends.mlx.engine.live.state import Live
    from prefixd.backends.mlx.engine.spec.config import SpecConfig
    from prefixd.backends.mlx.engine.spec.draft import PassCosts
    from prefixd.backends.mlx.engine.spec.speculate import Speculation

    config = SpecConfig(max_draft=8, ngram=2, leaves=(), costs=PassCosts(timed=False))
    short = [5, 6, 7, 8, 9, 5]            # after "5 6" came "7 8 9": a copy of reach 2
    long = [*range(20, 40), 1, *range(20, 39)]   # "20 .. 39" again: a copy of reach 20

    def member(prompt: list[int]) -> Live:
        run = Live(None, [], prompt, len(prompt), lambda: False)
        run.max_tokens, run.spec = 32, Speculation(config, prompt, 32)
        return run

    batch = Batch(None, PassCounts())
    copying, quiet = member(short), [member(short) for _ in range(3)]
    assert copying.spec is not None
    assert copying.spec.peek(copying, 6, 16) is not None      # it has a draft to offer
    assert not batch.would_verify([copying, *quiet], [6, 100, 100, 100])
    rates = {k: (r.wait, r.probe) for k, r in copying.spec.pace.rates.items()}
    copying.spec.pace.rates[2].probe = True                   # its probe after a wait
    assert batch.would_verify([copying, *quiet], [6, 100, 100, 100])
    copying.spec.pace.rates[2].probe = False
    assert {k: (r.wait, r.probe) for k, r in copying.spec.pace.rates.items()} == rates
    four = [member(long) for _ in range(4)]
    assert batch.would_verify(four, [39] * 4)
    assert not batch.would_verify([member(long) for _ in range(4)], [100] * 4)   # nothing
