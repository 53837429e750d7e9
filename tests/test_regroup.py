"""A burst's first prompts regrouped (`pacing.Regrouped`): a short prompt's first prefill pass,
picked the moment it arrived, or a shared pass of the prompts that arrived together, is taken
back in its first layers when requests that arrived meanwhile would share its pass, and all
of them prefill in one pass (`engine/batch/prefill.py`), on the real Engine and the
scheduler's own loop (`scheduler/loop.drive`). Each reply equals the same prompt's alone and
cold; arrivals that could not share leave the pass as it was; no prompt waits through more
than one pass taken back; a model whose prompts cannot share a pass (a hybrid) never takes
one back."""

from __future__ import annotations

import asyncio
import itertools
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
from prefixd.backends.mlx.model.tiny import build_model, model_from_config, tiny_config
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


def _burst(engine: Engine, tokenizer: Any, first: list[int], later: list[list[int]],
           visible: tuple[int, ...] = ()) -> list[str]:
    """`first` arrives alone; `later` arrive during its first pass (the loop peeks at them
    inside it, and takes them after it), the i-th peek finding the first `visible[i]` of them
    (past `visible`: all). Each prompt's reply, in that order."""
    return _waves(engine, tokenizer, [[first], later], visible)


def _waves(engine: Engine, tokenizer: Any, waves: list[list[list[int]]],
           visible: tuple[int, ...] = ()) -> list[str]:
    """The prompts of `waves[0]` arrive at once; those of each next wave when the first job
    of the wave before it starts (during its first pass: the loop peeks at them inside it,
    and takes them after it), the i-th peek finding the first `visible[i]` of them (past
    `visible`: all). Each prompt's reply, in order."""
    texts: dict[int, list[str]] = {}
    peeks = iter(range(1 << 30))

    def arrived() -> list[Job]:
        i = next(peeks)
        return list(inbox[0][:visible[i]] if i < len(visible) else inbox[0]) if inbox else []

    jobs = [[_job(p, texts) for p in wave] for wave in waves]
    inbox: list[list[Job]] = [jobs[0]]
    nexts = {id(wave[0]): after for wave, after in itertools.pairwise(jobs)}
    loaded = Loaded(engine.model, tokenizer, Renderer(tokenizer), engine, None)

    def take(idle: bool) -> list[Job] | None:
        out = inbox.pop(0) if inbox else []
        return None if idle and not out else out

    def start(job: Job, preempt: Callable[[], bool] | None,
              regroup: Callable[[], int] | None = None) -> Active:
        if id(job) in nexts:
            inbox.append(nexts.pop(id(job)))
        return Active(loaded, GrammarTokenizers(), job, Lockstep(), preempt, regroup)

    def batch(tasks: list[Any], stops: list[bool]) -> list[Step]:
        return step_batch(tasks, stops)

    def prefill(tasks: list[Any], stops: list[bool]) -> list[Step]:
        return prefill_together(tasks, stops)

    drive(Schedule(8, 64, engine.config.prefill_chunk, 1 << 40, 1), take, start,
          lambda job, result: None, arrived, batch,
          prefill if engine.prefills_together else None)
    return ["".join(texts[id(j)]) for wave in jobs for j in wave]


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


def test_arrivals_later_in_the_first_pass_still_share_it(tokenizer: Any) -> None:
    """On a model of 8 layers the first pass is asked about after its 1st, 2nd and 4th layers
    (its first half), and taken back once the arrivals that would share it stop growing in
    number: arrivals the first ask does not see yet, or that keep arriving, all share one
    pass with it; arrivals seen only after that half leave the pass as it was (and share one
    pass of their own). Replies equal each alone and cold."""
    model = model_from_config({**tiny_config("qwen3"), "num_hidden_layers": 8}, seed=5)
    rng = random.Random(53)
    prompts = [_words(rng, n) for n in (40, 37, 43)]
    alone = [_alone(model, tokenizer, p) for p in prompts]
    for visible in ((0,), (1,), (0, 1), (1, 1, 1)):
        engine = Engine(model, _settings(prefill_chunk=512))
        assert _burst(engine, tokenizer, prompts[0], prompts[1:], visible) == alone
        assert engine.passes.regrouped == 1 and engine.passes.passes["prefill"] == 1
        assert (engine.passes.shared, engine.passes.shared_prompts) == (1, 3)
    engine = Engine(model, _settings(prefill_chunk=512))
    assert _burst(engine, tokenizer, prompts[0], prompts[1:], (0, 0, 0)) == alone
    assert engine.passes.regrouped == 0
    assert (engine.passes.shared, engine.passes.shared_prompts) == (1, 2)


def test_a_shared_pass_is_taken_back_once_for_arrivals_during_it(tokenizer: Any) -> None:
    """Two prompts arriving at once share a pass; a third arriving during it takes it back
    and the three share one pass. A pass a row of which was taken back before is not taken
    back again (each prompt waits through at most one pass taken back): the third then
    prefills after it. Replies equal each alone and cold."""
    model = model_from_config({**tiny_config("qwen3"), "num_hidden_layers": 8}, seed=5)
    rng = random.Random(54)
    prompts = [_words(rng, n) for n in (40, 37, 43)]
    alone = [_alone(model, tokenizer, p) for p in prompts]
    engine = Engine(model, _settings(prefill_chunk=512))
    assert _waves(engine, tokenizer, [prompts[:2], prompts[2:]]) == alone
    assert engine.passes.regrouped == 1 and engine.passes.passes["prefill"] == 1
    assert (engine.passes.shared, engine.passes.shared_prompts) == (1, 3)
    engine = Engine(model, _settings(prefill_chunk=512))
    assert _waves(engine, tokenizer, [prompts[:1], prompts[1:2], prompts[2:]]) == alone
    assert engine.passes.regrouped == 1 and engine.passes.passes["prefill"] == 2
    assert (engine.passes.shared, engine.passes.shared_prompts) == (1, 2)


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
