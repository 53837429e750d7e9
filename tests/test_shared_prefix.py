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
from prefixd.backends.mlx.scheduler.policy.sharing import SHARE_MIN
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


def _submit(gen: Generator, tokens: list[int], namespace: str, max_tokens: int = 6,
            bounds: list[int] | None = None) -> Job:
    return gen.submit(Prompt(tokens, bounds or []), Sampling(temperature=0), max_tokens,
                      namespace=namespace)


async def _collect(job: Job, first: asyncio.Event | None = None) -> tuple[str, Finished]:
    text = []
    async for event in job.events():
        if isinstance(event, Delta):
            text.append(event.text)
            if first is not None:
                first.set()
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


@pytest.mark.parametrize("company", [0, 1], ids=["decoding_alone", "decoding_in_a_batch"])
async def test_a_sub_agent_arriving_after_the_shared_prompt_was_computed_restores_it(
        gen: Generator, company: int) -> None:
    """A sub-agent that arrives while another, past their shared system prompt, decodes (alone,
    or as a row of a decode batch) does not compute the prompt again, nor wait for the other's
    end: the running one stores the prompt's state from its live cache at once (where its
    recurrent layers cannot go back, from its checkpoint at the system prompt's end, a message
    boundary), and the late one restores it. Every reply equals a cold run's."""
    first, late = _prompts(11 + company, n=2)
    # beside the first: a short prompt sharing nothing, sent once the first decodes (it
    # prefills in one pass and joins the first's decode steps)
    others = [_prompts(13, n=1)[0][-48:]] if company else []
    ns, lengths = f"late-{company}", [240, *([240] * company)]
    running = []
    for p, n in zip([first, *others], lengths, strict=True):
        started = asyncio.Event()
        running.append(asyncio.ensure_future(_collect(_submit(gen, p, ns, n, [SHARED]),
                                                      started)))
        await started.wait()       # its reply under way: past its prompt
    assert not any(r.done() for r in running)
    late_text, late_end = await _collect(_submit(gen, late, ns, 6, [SHARED]))
    assert not all(r.done() for r in running)    # restored from a request still running
    assert late_end.cached_tokens >= SHARED
    got = [*(await asyncio.gather(*running)), (late_text, late_end)]
    cold = [await _collect(_submit(gen, p, f"late-cold-{company}-{i}", n, [SHARED]))
            for i, (p, n) in enumerate(zip([first, *others, late], [*lengths, 6],
                                           strict=True))]
    assert [t for t, _ in got] == [t for t, _ in cold]
    assert all(end.cached_tokens == 0 for _, end in cold)
