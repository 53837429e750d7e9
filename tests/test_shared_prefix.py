"""A prefix shared by requests that arrive together is computed once (issue 35): sub-agents
with one long system prompt sent in the same instant, in any order, to the real worker thread.
The first one started computes it and stores its state there the moment its prefill reaches
it; the others wait (not started), then restore it: their cached tokens cover the shared
prompt, and their replies are those of cold runs."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.scheduler.jobs import Finished, Job
from prefixd.backends.mlx.scheduler.output import Delta
from prefixd.backends.mlx.scheduler.schedule import SHARE_MIN
from prefixd.backends.mlx.settings import WorkerSettings
from tests.worker_fixtures import loaded

SHARED, TAIL = 900, 12


@pytest.fixture(scope="module", params=["qwen3", "qwen3_next"])
def gen(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]
        ) -> Iterator[Generator]:
    g = Generator(WorkerSettings(_env_file=None, use_system_blas=False, max_active=8,
                                 prefill_slice_ms=0, prefill_slice=128,
                                 checkpoint_interval=4096))
    loaded(g, str(tiny_model_dir(request.param)))
    yield g
    g.close()


def _prompts(seed: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 1000) for _ in range(SHARED)]
    return [[*system, *(rng.randrange(1, 1000) for _ in range(TAIL))] for _ in range(n)]


def _submit(gen: Generator, tokens: list[int], namespace: str) -> Job:
    return gen.submit(Prompt(tokens, []), Sampling(temperature=0), 6, namespace=namespace)


async def _collect(job: Job) -> tuple[str, Finished]:
    text = []
    async for event in job.events():
        if isinstance(event, Delta):
            text.append(event.text)
        elif isinstance(event, Finished):
            return "".join(text), event
    raise AssertionError("no last event")


@pytest.mark.parametrize("order", ["as_sent", "reversed"])
async def test_four_sub_agents_sent_together_compute_their_prompt_once(
        gen: Generator, order: str) -> None:
    prompts = _prompts(7 if order == "as_sent" else 8)
    if order == "reversed":
        prompts.reverse()
    ns = f"together-{order}"
    got = await asyncio.gather(*(_collect(_submit(gen, p, ns)) for p in prompts))
    cached = sorted(end.cached_tokens for _, end in got)
    assert cached[0] < SHARE_MIN            # one computed it
    assert all(c >= SHARED for c in cached[1:])   # the others restored all of it
    cold = [await _collect(_submit(gen, p, f"cold-{order}-{i}")) for i, p in enumerate(prompts)]
    assert [t for t, _ in got] == [t for t, _ in cold]
    assert all(end.cached_tokens == 0 for _, end in cold)


async def test_a_short_shared_prefix_is_not_waited_for(gen: Generator) -> None:
    """Below `SHARE_MIN` shared tokens nobody waits: each computes its own prompt."""
    rng = random.Random(9)
    head = [rng.randrange(1, 1000) for _ in range(SHARE_MIN // 4)]
    prompts = [[*head, *(rng.randrange(1, 1000) for _ in range(400))] for _ in range(3)]
    got = await asyncio.gather(*(_collect(_submit(gen, p, "short-head")) for p in prompts))
    assert [end.cached_tokens for _, end in got] == [0, 0, 0]
