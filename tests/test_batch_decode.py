"""Batched decode (issue 35) on the real worker thread and the five tiny architectures: requests
decoding together share one forward pass per step (`engine/batch/executor.py`), and each one's
greedy reply and log-probabilities are those it gets alone; the states they commit from a batch give
the next turn what a cold run gives; a request cancelled mid-batch leaves the others' replies
as they are; a seeded sampled request draws the same tokens in a batch as alone."""

from __future__ import annotations

import asyncio
import gc
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import greedy_sampler

from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.engine.run import Run
from prefixd.backends.mlx.engine.spec.row import argmax_rows
from prefixd.backends.mlx.model.tiny import ARCHS
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.scheduler.jobs import Finished, Job
from tests.worker_fixtures import batching, collect

TOKENS = 16
LOGPROB_TOLERANCE = 2e-4   # kernels batched over rows round differently (measured: to 1.01e-4)


@pytest.fixture(scope="module", params=ARCHS)
def gen(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]
        ) -> Iterator[Generator]:
    g = batching(tiny_model_dir(request.param))
    yield g
    g.close()


def _prompts(seed: int, lengths: tuple[int, ...] = (9, 40, 75, 130)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(n)] for n in lengths]


def _submit(gen: Generator, tokens: list[int], namespace: str, max_tokens: int = TOKENS,
            sampling: Sampling | None = None) -> Job:
    return gen.submit(Prompt(tokens, []), sampling or Sampling(temperature=0), max_tokens,
                      logprobs=0, namespace=namespace)


def _batch(gen: Generator) -> dict[str, Any]:
    assert gen.loaded is not None
    return dict(gen.loaded.engine.cache_info()["batch"])


async def _alone(gen: Generator, prompts: list[list[int]], namespace: str
                 ) -> list[tuple[str, list[float], Finished]]:
    return [await collect(_submit(gen, p, namespace)) for p in prompts]


async def _together(gen: Generator, prompts: list[list[int]], namespace: str
                    ) -> list[tuple[str, list[float], Finished]]:
    return list(await asyncio.gather(*(collect(_submit(gen, p, namespace))
                                       for p in prompts)))


def _same(got: list[tuple[str, list[float], Finished]],
          want: list[tuple[str, list[float], Finished]]) -> None:
    for (text, lps, end), (text0, lps0, end0) in zip(got, want, strict=True):
        assert text == text0
        assert end.completion_tokens == end0.completion_tokens == len(lps) == len(lps0)
        assert max(abs(a - b) for a, b in zip(lps, lps0, strict=True)) <= LOGPROB_TOLERANCE


def _held(gen: Generator, prompts: list[list[int]], namespace: str) -> list[list[int]]:
    """Each conversation as the worker holds it now (its longest entry past the prompt)."""
    assert gen.loaded is not None
    store = gen.loaded.engine.store
    return [max((e.tokens for e in store.entries
                 if e.namespace == namespace and e.tokens[:len(p)] == p), key=len)
            for p in prompts]


async def _next_turns_warm(gen: Generator, held: list[list[int]], namespace: str, seed: int,
                           more: int) -> None:
    """Each held conversation and `more` new tokens, restored (warm), equals a cold run, and
    restores all of what is held."""
    rng = random.Random(seed)
    follow = [[*h, *(rng.randrange(1, 1000) for _ in range(more))] for h in held]
    warm = await _alone(gen, follow, namespace)
    cold = await _alone(gen, follow, namespace + "-cold")
    _same(warm, cold)
    assert all(end.cached_tokens >= len(f) - more - 1
               for (_, _, end), f in zip(warm, follow, strict=True))


async def test_requests_decoding_together_share_a_pass_and_reply_as_alone(
        gen: Generator) -> None:
    prompts = _prompts(1)
    alone = await _alone(gen, prompts, "alone")
    before = _batch(gen)
    together = await _together(gen, prompts, "together")
    after = _batch(gen)
    _same(together, alone)
    passes = after["decode_passes"] - before["decode_passes"]
    tokens = after["decode_tokens"] - before["decode_tokens"]
    # 4 requests x (TOKENS - 1) fed tokens (+1 each at its end), in far fewer passes than alone
    assert tokens >= 4 * (TOKENS - 1)
    assert passes <= tokens / 2
    assert after["largest_decode_batch"] == 4


async def test_a_newcomer_ends_its_prefill_in_the_decoding_requests_pass(
        gen: Generator) -> None:
    """Requests that arrive while another decodes feed their prompt's last token as rows of
    its next decode pass (no pass of their own for their first token): each replies as it
    does alone, and its next turn restores what that pass left (warm) and equals cold."""
    prompts = _prompts(8, (24, 41, 57))
    alone = await _alone(gen, prompts, "ride-alone")
    before = _batch(gen)
    first = _submit(gen, prompts[0], "ride", max_tokens=64)
    events = first.events()
    async for _ in events:      # its first token: it decodes now
        break
    later = await asyncio.gather(*(collect(_submit(gen, p, "ride")) for p in prompts[1:]))
    async for _ in events:
        pass
    after = _batch(gen)
    assert after["prompts_ended_in_decode"] - before["prompts_ended_in_decode"] >= 2
    _same(later, alone[1:])
    await _next_turns_warm(gen, _held(gen, prompts[1:], "ride"), "ride", 8, 5)


async def test_fresh_short_prompts_sent_together_share_one_prefill_pass(gen: Generator) -> None:
    """Prompts that arrive together with nothing cached prefill all but their last token in
    one pass (an all-KV model: the others' caches need passes of their own), then their last
    tokens ride one decode pass: each replies as alone, and its next turn is warm and equals
    cold."""
    assert gen.loaded is not None
    prompts = _prompts(9, (30, 33, 36, 31))
    alone = await _alone(gen, prompts, "shared-alone")
    before = _batch(gen)
    together = await _together(gen, prompts, "shared")
    after = _batch(gen)
    _same(together, alone)
    shared = after["prompts_prefilled_together"] - before["prompts_prefilled_together"]
    if gen.loaded.engine.prefills_together:
        assert after["shared_prefill_passes"] > before["shared_prefill_passes"]
        assert shared >= 2
        assert after["prompts_ended_in_decode"] - before["prompts_ended_in_decode"] >= 2
    else:
        assert shared == 0
    await _next_turns_warm(gen, _held(gen, prompts, "shared"), "shared", 9, 5)


async def test_follow_up_turns_sent_together_share_one_prefill_pass(gen: Generator) -> None:
    """Follow-up turns that arrive together, each restoring its own conversation (prefixes of
    different lengths), prefill their new tokens (of different lengths) in one pass: each
    restores what it held, replies as the same turn does cold and alone, and its next turn
    is warm and equals cold."""
    assert gen.loaded is not None
    first = _prompts(10, (25, 60, 41))
    await _together(gen, first, "follow")
    held = _held(gen, first, "follow")
    rng = random.Random(10)
    turns = [[*h, *(rng.randrange(1, 1000) for _ in range(n))]
             for h, n in zip(held, (14, 9, 17), strict=True)]
    cold = await _alone(gen, turns, "follow-cold")
    before = _batch(gen)
    warm = await _together(gen, turns, "follow")
    after = _batch(gen)
    _same(warm, cold)
    assert all(end.cached_tokens >= len(h) for (_, _, end), h in zip(warm, held, strict=True))
    shared = after["prompts_prefilled_together"] - before["prompts_prefilled_together"]
    if gen.loaded.engine.prefills_together:
        assert after["shared_prefill_passes"] > before["shared_prefill_passes"]
        assert shared >= 2
    else:
        assert shared == 0
    await _next_turns_warm(gen, _held(gen, turns, "follow"), "follow", 10, 5)


async def test_a_request_ending_in_company_feeds_no_pass_of_its_own(gen: Generator) -> None:
    """A reply that ends while others decode beside it is stored without its last token (a
    pass of that token alone would hold up the others); the last one to end, alone, is
    stored whole. Either way the next turn is warm and equals cold."""
    assert gen.loaded is not None
    prompts = _prompts(10, (24, 24, 24))
    budgets = (6, 11, 24)
    jobs = [gen.submit(Prompt(p, []), Sampling(temperature=0), n, logprobs=0,
                       namespace="ends") for p, n in zip(prompts, budgets, strict=True)]
    ended = await asyncio.gather(*(collect(j) for j in jobs))
    held = _held(gen, prompts, "ends")
    done = [end.completion_tokens for _, _, end in ended]
    assert done == list(budgets)
    assert [len(h) - len(p) for h, p in zip(held, prompts, strict=True)] == \
        [budgets[0] - 1, budgets[1] - 1, budgets[2]]
    await _next_turns_warm(gen, held, "ends", 10, 4)


async def test_the_next_turn_after_a_batched_reply_is_warm_and_equals_cold(
        gen: Generator) -> None:
    """The states committed out of a batch (extracted, then stored) restore to what a cold
    prefill of the same tokens gives: the follow-up turns, batched too, equal cold runs."""
    assert gen.loaded is not None
    prompts = _prompts(2)
    await _together(gen, prompts, "turns")
    store = gen.loaded.engine.store
    rng = random.Random(3)
    follow = []
    for p in prompts:   # each conversation as the worker holds it (prompt + reply), then more
        held = max((e.tokens for e in store.entries
                    if e.namespace == "turns" and e.tokens[:len(p)] == p), key=len)
        assert len(held) > len(p)
        follow.append([*held, *(rng.randrange(1, 1000) for _ in range(7))])
    warm = await _together(gen, follow, "turns")
    cold = await _alone(gen, follow, "turns-cold")
    _same(warm, cold)
    for (_, _, end), p in zip(warm, follow, strict=True):
        assert end.cached_tokens >= len(p) - 7 - 1
    assert all(end.cached_tokens == 0 for _, _, end in cold)


async def test_a_request_cancelled_mid_batch_leaves_the_others_as_alone(
        gen: Generator) -> None:
    prompts = _prompts(4, (12, 50, 90))
    alone = await _alone(gen, prompts, "cancel-alone")
    jobs = [_submit(gen, p, "cancel-together") for p in prompts]
    got = await asyncio.gather(collect(jobs[0]), collect(jobs[1], cancel_after=3),
                               collect(jobs[2]))
    assert got[1][2].finish_reason == "cancelled"
    assert 3 <= got[1][2].completion_tokens < TOKENS
    _same([got[0], got[2]], [alone[0], alone[2]])
    assert not gen._pending


async def test_seeded_sampling_in_a_batch_draws_as_alone(gen: Generator) -> None:
    prompts = _prompts(5, (20, 33, 61))
    sampling = Sampling(temperature=1.3, seed=99)
    alone = [await collect(_submit(gen, p, "seed-alone", sampling=sampling)) for p in prompts]
    together = await asyncio.gather(*(collect(_submit(gen, p, "seed-together",
                                                       sampling=sampling)) for p in prompts))
    assert [t for t, _, _ in together] == [t for t, _, _ in alone]
    assert all(t for t, _, _ in alone)


async def test_without_batch_decode_each_pass_is_one_request(
        tiny_model_dir: Callable[[str], Path]) -> None:
    """`batch_decode` false (or a model whose caches cannot merge): the same replies, one
    request per decode pass."""
    g = batching(tiny_model_dir("qwen3"), batch_decode=False)
    try:
        prompts = _prompts(6, (10, 30, 50))
        alone = await _alone(g, prompts, "a")
        together = await _together(g, prompts, "b")
        _same(together, alone)
        assert _batch(g)["largest_decode_batch"] == 1
    finally:
        g.close()


async def test_a_finished_request_leaves_no_device_memory_to_the_cycle_collector(
        gen: Generator) -> None:
    """Requests that ran together (one cancelled mid-batch, one published a shared prefix),
    then again (their entries superseded), hold no arrays once they end, beyond what the
    store keeps: nothing unreachable still
    holds device memory until Python's cycle collector runs (it seldom runs in a worker,
    which allocates few Python objects: measured on the built-in model, the worker's MLX
    memory grew ~12 MiB a request, over 1 GB in 60 requests, with its cache flat)."""
    rng = random.Random(21)
    shared = [rng.randrange(1, 1000) for _ in range(300)]
    prompts = [*_prompts(22), [*shared, 5], [*shared, 6, 7]]
    # the scheduler's view of its last pick may still name earlier tests' (seeded) jobs
    await collect(_submit(gen, [1, 2, 3], "cycles-first", max_tokens=2))
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):     # the second time, entries merge and the first ones go
            jobs = [_submit(gen, p, "cycles", max_tokens=4) for p in prompts]
            await asyncio.gather(*(collect(j, cancel_after=3 if i == 1 else None)
                                   for i, j in enumerate(jobs)))
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        # a seeded sampler's 8-byte random keys aside (an earlier test's jobs, let go by the
        # test event loop in the meantime): KV buffers, states and logits are KBs even here
        held = [o for o in gc.garbage if isinstance(o, mx.array) and o.nbytes > 64]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert held == [], f"{len(held)} arrays, {sum(a.nbytes for a in held)} bytes"


@pytest.mark.parametrize("vocab", [2048, 49152, 151936])
def test_greedy_rows_draw_together_as_each_alone(vocab):
    """A batch's greedy members draw in one graph (`argmax_rows`): each row's token is the one
    its own `Run.draw` gives, on logits with near-ties (values on a coarse grid, so rows share
    maxima and the normalization rounds)."""
    run = Run(None, [], [1], 0, None, lambda: False)
    run.sampler, run.processors = greedy_sampler, []
    assert run.plain
    rng = np.random.default_rng(vocab)
    for rows in (2, 5, 16):
        logits = mx.array(np.round(rng.normal(size=(rows, vocab)) * 4, 1).astype(np.float32))
        together = argmax_rows(logits).tolist()
        assert together == [int(run.draw(logits[i:i + 1]).item()) for i in range(rows)]
    run.processors = [lambda tokens, logits: logits]
    assert not run.plain
