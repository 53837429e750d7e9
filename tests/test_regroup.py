"""A burst's first prompt regrouped (`pacing.Regrouped`): a short prompt's first prefill pass,
picked the moment it arrived, is taken back one layer in when requests that arrived meanwhile
would share its pass, and all of them prefill in one pass (`engine/batch/prefill.py`), on the
real Engine and the scheduler's own loop (`scheduler/loop.drive`). Each reply equals the same
prompt's alone and cold; arrivals that could not share leave the pass as it was; a model whose
prompts cannot share a pass (a hybrid) never takes one back."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

from prefixd.backends.mlx.chat.prompt import Prompt, Renderer
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.engine.engine import Engine
from prefixd.backends.mlx.engine.loading import Loaded
from prefixd.backends.mlx.grammar.matcher import GrammarTokenizers
from prefixd.backends.mlx.group.lockstep import Lockstep
from prefixd.backends.mlx.model.tiny import build_model
from prefixd.backends.mlx.scheduler.active import Active, prefill_together, step_batch
from prefixd.backends.mlx.scheduler.jobs import Job
from prefixd.backends.mlx.scheduler.loop import drive
from prefixd.backends.mlx.scheduler.output import Delta
from prefixd.backends.mlx.scheduler.policy.plan import regroups
from prefixd.backends.mlx.scheduler.policy.schedule import Schedule
from prefixd.backends.mlx.scheduler.policy.slots import Slot
from prefixd.backends.mlx.scheduler.policy.steps import Step
from tests.test_checkpoints import _run, _settings, _words
from tests.test_schedule import _text

MAX = 6


def _job(tokens: list[int], texts: dict[int, list[str]]) -> Job:
    job = Job(Prompt(list(tokens), []), Sampling(temperature=0), MAX, None,
              lambda e: None, asyncio.Queue())
    texts[id(job)] = []
    job.emit = lambda e: texts[id(job)].append(e.text) if isinstance(e, Delta) else None
    return job


def _burst(engine: Engine, tokenizer: Any, first: list[int], later: list[list[int]]
           ) -> list[str]:
    """`first` arrives alone; `later` arrive during its first pass (the loop peeks at them
    inside it, and takes them after it). Each prompt's reply, in that order."""
    texts: dict[int, list[str]] = {}
    jobs = [_job(first, texts), *(_job(p, texts) for p in later)]
    inbox: list[list[Job]] = [[jobs[0]]]
    loaded = Loaded(engine.model, tokenizer, Renderer(tokenizer), engine, None)

    def take(idle: bool) -> list[Job] | None:
        out = inbox.pop(0) if inbox else []
        return None if idle and not out else out

    def start(job: Job, preempt: Callable[[], bool] | None,
              regroup: Callable[[], bool] | None = None) -> Active:
        if job is jobs[0]:
            inbox.append(jobs[1:])
        return Active(loaded, GrammarTokenizers(), job, Lockstep(), preempt, regroup)

    def batch(tasks: list[Any], stops: list[bool]) -> list[Step]:
        return step_batch(tasks, stops)

    def prefill(tasks: list[Any], stops: list[bool]) -> list[Step]:
        return prefill_together(tasks, stops)

    drive(Schedule(8, 64, engine.config.prefill_chunk, 1 << 40, 1), take, start,
          lambda job, result: None, lambda: list(inbox[0]) if inbox else [], batch,
          prefill if engine.prefills_together else None)
    return ["".join(texts[id(j)]) for j in jobs]


def _alone(model: Any, tokenizer: Any, prompt: list[int]) -> str:
    return _text(tokenizer, _run(Engine(model, _settings(cache_bytes=0, prefill_chunk=512)),
                                 prompt, max_tokens=MAX)[0])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Callable[[str], Any]) -> Any:
    from mlx_lm.tokenizer_utils import load
    return load(tiny_model_dir("qwen3"))


@pytest.fixture(scope="module", params=["qwen3", "qwen3_next"])
def model(request: pytest.FixtureRequest) -> Any:
    return build_model(request.param, seed=5)


def test_a_bursts_first_pass_is_taken_back_and_shared(model: Any, tokenizer: Any) -> None:
    rng = random.Random(51)
    prompts = [_words(rng, n) for n in (40, 37, 43)]
    engine = Engine(model, _settings(prefill_chunk=512))
    replies = _burst(engine, tokenizer, prompts[0], prompts[1:])
    assert replies == [_alone(model, tokenizer, p) for p in prompts]
    if engine.prefills_together:      # all-KV: the three prompts in one pass
        assert engine.passes.regrouped == 1
        assert (engine.passes.shared, engine.passes.shared_prompts) == (1, 3)
        assert engine.passes.passes["prefill"] == 1
    else:                             # a hybrid's prompts each take passes of their own
        assert engine.passes.regrouped == 0 and engine.passes.shared == 0


def test_arrivals_that_cannot_share_leave_the_first_pass_as_it_was(model: Any,
                                                                   tokenizer: Any) -> None:
    """A long prompt (past the slice) arriving during a short one's first pass: nothing is
    taken back, the short one's pass runs to its end once."""
    rng = random.Random(52)
    prompts = [_words(rng, 40), _words(rng, 300)]
    engine = Engine(model, _settings(prefill_chunk=512))
    replies = _burst(engine, tokenizer, prompts[0], prompts[1:])
    assert replies == [_alone(model, tokenizer, p) for p in prompts]
    assert engine.passes.regrouped == 0 and engine.passes.shared == 0


def test_the_plan_regroups_only_for_arrivals_that_share_its_pass() -> None:
    """Pure: a first pass under way (a started job, nothing of it run) is taken back for
    newcomers that share its prompt's pass, not for one too long or padded too much, nor
    for none."""
    def slot(n: int, cached: int = 0, started: bool = False) -> Slot:
        s = Slot(Job(Prompt([1] * n, []), Sampling(temperature=0), 4, None, lambda e: None,
                     asyncio.Queue()), 0, cached=cached)
        if started:
            s.task = _Started(n - cached)
        return s
    running = slot(40, started=True)
    assert regroups(running, [slot(38)], 64)
    assert regroups(running, [slot(300), slot(44)], 64)
    assert not regroups(running, [slot(300)], 64)         # past the slice
    assert not regroups(running, [slot(8)], 64)           # padded 5x
    assert not regroups(running, [], 64)
    assert regroups(slot(1000, cached=960, started=True), [slot(990, cached=950)], 64)
    assert not regroups(slot(1000, cached=960, started=True), [slot(40)], 64)


class _Started:
    """A task whose first pass is under way: `left` prompt tokens not yet in its cache."""

    def __init__(self, left: int) -> None:
        self.left = left

    def remaining(self) -> int:
        return self.left
