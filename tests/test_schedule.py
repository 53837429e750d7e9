"""The scheduler (`schedule.py`) over the real Engine on the five tiny architectures: jobs
interleaved a forward pass at a time, with sliced prefills, give the serial outputs; their
checkpoints land where an unsliced prefill puts them; warm == cold holds after them; a
cancelled job stops within one pass; a pass paused between two layers for a newcomer gives what
it gives unpaused (also on llama, gemma2 and mamba2). And the pure policy: shortest remaining
prefill first, pauses, aging, admission by live-cache bytes.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from prefixd.backends.mlx.chat.prompt import Prompt, Renderer
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.engine.config import EngineConfig
from prefixd.backends.mlx.engine.engine import Engine
from prefixd.backends.mlx.engine.loading import Loaded
from prefixd.backends.mlx.engine.stats import PromptStats
from prefixd.backends.mlx.grammar.matcher import GrammarTokenizers
from prefixd.backends.mlx.group.lockstep import Lockstep
from prefixd.backends.mlx.model.tiny import model_from_config, tiny_config
from prefixd.backends.mlx.scheduler.active import Active
from prefixd.backends.mlx.scheduler.jobs import Job
from prefixd.backends.mlx.scheduler.loop import drive
from prefixd.backends.mlx.scheduler.output import Delta
from prefixd.backends.mlx.scheduler.policy.plan import MOST, Plan, prefill_rows
from prefixd.backends.mlx.scheduler.policy.schedule import AGE_LIMIT, MIN_SLICE, Schedule
from prefixd.backends.mlx.scheduler.policy.slots import Slot
from prefixd.backends.mlx.scheduler.policy.steps import (
    Decision,
    Decoded,
    Finished,
    Paused,
    Prefilled,
    Step,
)
from prefixd.backends.mlx.scheduler.sizing import request_bytes
from tests.test_checkpoints import CountingModel, _assert_same, _cold, _run, _settings, _words

BOUNDS = (60, 150, 220)


def _job(tokens: Sequence[int], max_tokens: int = 4) -> Job:
    return Job(Prompt(list(tokens), []), Sampling(temperature=0), max_tokens, None,
               lambda e: None, asyncio.Queue())


class Observed:
    """The worker's own `Active` on the Engine, its typed steps logged as they come, its text
    kept (an observer: every step is the real one)."""

    def __init__(self, engine: Engine, tokenizer: Any, job: Job, log: list[str], name: str,
                 bounds: Sequence[int] = (), preempt: Callable[[], bool] | None = None) -> None:
        self.deltas: list[str] = []
        job.prompt = Prompt(job.prompt.tokens, list(bounds))
        job.emit = lambda e: self.deltas.append(e.text) if isinstance(e, Delta) else None
        loaded = Loaded(engine.model, tokenizer, Renderer(tokenizer), engine, None)
        self.active = Active(loaded, GrammarTokenizers(), job, Lockstep(), preempt)
        self.job, self.log, self.name, self.turn = job, log, name, self.active.turn

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    def remaining(self) -> int:
        return self.active.remaining()

    def ready(self) -> bool:
        return self.active.ready()

    def pass_rate(self) -> float | None:
        return None

    def length(self) -> int:
        return self.active.length()

    def publish(self, at: int) -> int | None:
        return self.active.publish(at)

    def step(self, decision: Decision) -> Step:
        step = self.active.step(decision)
        kind = {Prefilled: "prefill", Paused: "pause", Decoded: "token"}.get(type(step), "end")
        self.log.append(f"{self.name}:{kind}")
        return step


def _text(tokenizer: Any, tokens: list[int]) -> str:
    """What the worker sends of these sampled tokens: up to the first end-of-sequence."""
    eos = set(tokenizer.eos_token_ids)
    ended = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return str(tokenizer.decode(tokens[:ended]))


def _interleave(engine: Engine, tokenizer: Any, jobs: dict[str, tuple[Job, Sequence[int]]],
                slice_: int = 5) -> tuple[dict[str, Observed], list[str]]:
    log: list[str] = []
    tasks: dict[str, Observed] = {}
    schedule = Schedule(2, slice_, engine.config.prefill_chunk, 1 << 40, 1)
    arrivals = [[job] for job, _ in jobs.values()]   # one per pass: the first starts alone
    names = {id(job): (name, bounds) for name, (job, bounds) in jobs.items()}

    def take(idle: bool) -> list[Job] | None:
        out = arrivals.pop(0) if arrivals else []
        return None if idle and not out else out

    def start(job: Job, preempt: Callable[[], bool] | None,
              regroup: Callable[[], int] | None = None) -> Observed:
        name, bounds = names[id(job)]
        tasks[name] = Observed(engine, tokenizer, job, log, name, bounds, preempt)
        return tasks[name]

    drive(schedule, take, start, lambda job, result: log.append(f"ended:{result}"))
    return tasks, log


def test_interleaved_jobs_equal_serial_and_checkpoints_land_in_place(
        model: CountingModel, tokenizer: Any) -> None:
    rng = random.Random(26)
    long, short = _words(rng, 300), _words(rng, 12)
    engine = Engine(model, _settings())
    tasks, log = _interleave(engine, tokenizer,
                             {"long": (_job(long), BOUNDS), "short": (_job(short), ())})
    # the long one started first (alone: a whole chunk), the short one ran to its end while
    # the long one was still prefilling
    assert log[0] == "long:prefill"
    assert log.index("short:end") < log.index("long:token")
    assert "long:prefill" in log[log.index("short:end"):]
    serial = Engine(model, _settings())
    want_long = _run(serial, long, BOUNDS)
    want_short = _run(serial, short)
    assert tasks["long"].text == _text(tokenizer, want_long[0])
    assert tasks["short"].text == _text(tokenizer, want_short[0])
    _assert_in_place_then_warm(engine, model, long, want_long[0], rng)


def _assert_in_place_then_warm(engine: Engine, model: CountingModel, long: list[int],
                               reply: list[int], rng: random.Random) -> PromptStats:
    """`engine`'s checkpoints of `long` sit where an unsliced, unpaused prefill puts them, and
    warm == cold from its state and checkpoints; the stats of that prefill alone."""
    alone = Engine(model, _settings())
    alone_stats = _run(alone, long, BOUNDS)[2]

    def marks(e: Engine, tokens: list[int]) -> set[int]:
        return {p for x in e.store.entries if x.tokens[:len(tokens)] == tokens
                for p in x.checkpoints}

    assert marks(engine, long) == marks(alone, long)
    for prompt in (long + reply + _words(rng, 7), long[:170] + _words(rng, 20)):
        warm = _run(engine, prompt, BOUNDS)
        assert warm[2].cached_tokens > 0
        _assert_same(warm, _cold(model, prompt))
    return alone_stats


def test_a_short_job_arriving_during_a_pass_runs_before_that_pass_ends(
        model: CountingModel, tokenizer: Any) -> None:
    """The long prompt's pass under way pauses after a layer for a short prompt that arrives
    during it; the short one runs to its end, then the pass resumes where it stopped. Outputs,
    pass sizes and checkpoints are those of the serial runs, and warm == cold holds after."""
    rng = random.Random(28)
    long, short = _words(rng, 300), _words(rng, 10)
    engine = Engine(model, _settings())
    chunk = engine.config.prefill_chunk
    tasks, log = _interleave_mid_pass(engine, tokenizer, long, short)
    assert log[0] == "long:pause"
    assert log.index("short:end") < log.index("long:prefill")
    run = tasks["long"].turn.run
    assert run is not None and run.yields == 1
    assert run.segments[0][0] == chunk            # the paused pass was not cut short
    serial = Engine(model, _settings())
    want_long, want_short = _run(serial, long, BOUNDS), _run(serial, short)
    assert tasks["long"].text == _text(tokenizer, want_long[0])
    assert tasks["short"].text == _text(tokenizer, want_short[0])
    segments = [n for n, _ in run.segments]         # before the warm runs reuse the engine
    alone_stats = _assert_in_place_then_warm(engine, model, long, want_long[0], rng)
    assert segments == [n for n, _ in alone_stats.segments]


# Beyond the five tiny architectures: other mlx-lm classes and cache types a pass pauses over
_BASE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": 1024,
         "max_position_embeddings": 4096, "tie_word_embeddings": False, "num_hidden_layers": 3,
         "rope_theta": 10000.0}
OTHER_ARCHS = {
    "llama": {"model_type": "llama", **_BASE},
    "gemma2": {"model_type": "gemma2", **_BASE, "query_pre_attn_scalar": 16,
               "sliding_window": 64, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    "mamba2": {"model_type": "mamba2", "vocab_size": 1024, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 3, "num_heads": 8, "head_dim": 16,
               "n_groups": 1, "state_size": 16, "conv_kernel": 4, "expand": 2,
               "time_step_rank": 4, "use_bias": False, "use_conv_bias": True,
               "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
               "time_step_limit": [0.0, 1e9], "time_step_min": 0.001, "time_step_max": 0.1,
               "chunk_size": 64, "residual_in_fp32": True, "rms_norm": True,
               "norm_before_gate": False},
}


@pytest.mark.parametrize("arch", sorted(OTHER_ARCHS))
def test_a_pass_pauses_exactly_on_other_architectures(arch: str, tokenizer: Any) -> None:
    from prefixd.backends.mlx.model.tiny import model_from_config
    model = CountingModel(model_from_config(OTHER_ARCHS[arch], seed=1))
    rng = random.Random(31)
    long, short = _words(rng, 300), _words(rng, 10)
    engine = Engine(model, _settings())
    tasks, log = _interleave_mid_pass(engine, tokenizer, long, short)
    run = tasks["long"].turn.run
    assert log[0] == "long:pause" and run is not None and run.yields == 1
    serial = Engine(model, _settings())
    assert tasks["long"].text == _text(tokenizer, _run(serial, long, BOUNDS)[0])
    assert tasks["short"].text == _text(tokenizer, _run(serial, short)[0])


def _interleave_mid_pass(engine: Engine, tokenizer: Any, long: list[int], short: list[int]
                         ) -> tuple[dict[str, Observed], list[str]]:
    """The long prompt starts alone; the short one arrives during its first pass."""
    log: list[str] = []
    tasks: dict[str, Observed] = {}
    inbox: list[list[Job]] = [[_job(long)]]
    later = [_job(short)]

    def take(idle: bool) -> list[Job] | None:
        out = inbox.pop(0) if inbox else []
        return None if idle and not out else out

    def start(job: Job, preempt: Callable[[], bool] | None,
              regroup: Callable[[], int] | None = None) -> Observed:
        name = "long" if job.prompt.tokens == long else "short"
        tasks[name] = Observed(engine, tokenizer, job, log, name,
                               BOUNDS if name == "long" else (), preempt)
        if name == "long":
            inbox.append(later)       # the short one arrives during the long one's first pass
        return tasks[name]

    drive(Schedule(2, 12, engine.config.prefill_chunk, 1 << 40, 1), take, start,
          lambda job, result: None, lambda: list(inbox[0]) if inbox else [])
    return tasks, log


def test_a_paused_job_whose_client_left_ends_after_its_pass(model: CountingModel,
                                                            tokenizer: Any) -> None:
    """A job cancelled while its pass is paused runs first: the rest of that pass (no more
    pauses), then it ends, and what it computed is committed and restores exactly."""
    rng = random.Random(29)
    long, short = _words(rng, 300), _words(rng, 10)
    engine = Engine(model, _settings())
    chunk = engine.config.prefill_chunk
    log: list[str] = []
    jobs = {"long": _job(long), "short": _job(short)}
    inbox: list[list[Job]] = [[jobs["long"]]]
    later = [jobs["short"]]

    def take(idle: bool) -> list[Job] | None:
        out = inbox.pop(0) if inbox else []
        return None if idle and not out else out

    def start(job: Job, preempt: Callable[[], bool] | None,
              regroup: Callable[[], int] | None = None) -> Observed:
        name = "long" if job is jobs["long"] else "short"
        if name == "short":
            jobs["long"].cancel()              # its client leaves while its pass is paused
        else:
            inbox.append(later)                # the short one arrives during its first pass
        return Observed(engine, tokenizer, job, log, name, BOUNDS if name == "long" else (),
                        preempt)

    drive(Schedule(2, 12, chunk, 1 << 40, 1), take, start, lambda job, result: None,
          lambda: list(inbox[0]) if inbox else [])
    assert log[:4] == ["long:pause", "short:prefill", "long:prefill", "long:end"]
    assert log[-1] == "short:end"
    assert [len(e.tokens) for e in engine.store.entries if e.tokens == long[:len(e.tokens)]] \
        == [chunk]
    warm = _run(engine, long[:chunk] + short)
    assert warm[2].cached_tokens == chunk
    _assert_same(warm, _cold(model, long[:chunk] + short))


def test_a_cancelled_job_stops_within_one_slice(model: CountingModel, tokenizer: Any) -> None:
    rng = random.Random(27)
    long, short = _words(rng, 300), _words(rng, 40)
    engine = Engine(model, _settings())
    job = _job(long)
    task = Observed(engine, tokenizer, job, [], "long", BOUNDS)
    for _ in range(3):
        assert task.step(Decision(5, job.cancelled)) == Prefilled(5)
    assert task.turn.run is not None and task.turn.run.pos == 15
    job.cancel()
    end = task.step(Decision(5, job.cancelled))
    assert isinstance(end, Finished) and end.finish_reason == "cancelled"
    # what it computed is committed (the store holds its first 15 tokens)
    assert [len(e.tokens) for e in engine.store.entries] == [15]
    warm = _run(engine, long[:15] + short)
    assert warm[2].cached_tokens == 15
    _assert_same(warm, _cold(model, long[:15] + short))


class FakeTask:
    def __init__(self, left: int, rate: float | None = None, length: int = 0) -> None:
        self.left, self.rate, self.held = left, rate, length

    def remaining(self) -> int:
        return self.left

    def ready(self) -> bool:
        return False

    def length(self) -> int:
        return self.held

    def pass_rate(self) -> float | None:
        return self.rate

    def step(self, decision: Decision) -> Step:
        self.left = max(0, self.left - 256)   # a pass of prefill_slice tokens
        return Prefilled(256)

    def publish(self, at: int) -> int | None:
        return 0    # a recurrent model with no checkpoint below `at`: nothing stored


def test_the_plan_shares_a_prefill_pass_among_fresh_short_prompts_of_like_length() -> None:
    """Fresh short prompts (not started, nothing cached, at most `prefill_slice` tokens) of
    like length share one prefill pass; one started, one long and one whose padding would
    cost too much run their own."""
    schedule = Schedule(8, 256, 512, 1 << 30, 1)
    lengths = (40, 44, 38, 42, 400, 41, 5, 43)
    for n in lengths:
        schedule.add(_job([1] * n))
    slots = schedule.admit()
    slots[7].task = FakeTask(43)      # started
    plan = schedule.plan(slots[0], together=True)
    assert plan.kind == "prefill" and plan.slots[0] is slots[0]
    assert {lengths[slots.index(s)] for s in plan.slots} == {40, 44, 38, 42, 41}
    assert schedule.plan(slots[4], together=True) == Plan("step", [slots[4]])   # too long
    assert schedule.plan(slots[6], together=True).slots[0] is slots[6]
    assert slots[6] not in schedule.plan(slots[0], together=True).slots   # 8: padded 8.8x
    assert schedule.plan(slots[0], together=False) == Plan("step", [slots[0]])
    rows = prefill_rows(slots[0], [*slots, *(Slot(_job([1] * 40), 0) for _ in range(9))],
                        (), 256)
    assert len(rows) == MOST


def test_the_plan_shares_a_prefill_pass_among_follow_ups_of_like_length() -> None:
    """Follow-up turns (a conversation's prefix cached) share a pass by the tokens each
    computes and by the positions each attends to: a follow-up of 1,000 tokens (40 new) with
    another of like length, not with a fresh prompt of 40 tokens (its pass would attend over
    1,000 positions of padding); a follow-up whose new tokens are the last alone, and one
    past `CONTEXT`, run their own."""
    schedule = Schedule(8, 256, 512, 1 << 30, 1)
    lengths = (1000, 1010, 40, 990, 1000, 3000)
    for n in lengths:
        schedule.add(_job([1] * n))
    slots = schedule.admit()
    for s, cached in zip(slots, (960, 975, 0, 950, 999, 2960), strict=True):
        s.cached = cached
    assert schedule.plan(slots[0], together=True) == Plan("prefill", [slots[0], slots[3],
                                                                      slots[1]])
    assert schedule.plan(slots[2], together=True) == Plan("step", [slots[2]])
    assert schedule.plan(slots[4], together=True) == Plan("step", [slots[4]])   # 1 new token
    assert schedule.plan(slots[5], together=True) == Plan("step", [slots[5]])   # > CONTEXT


def test_policy_soonest_first_token_then_shortest_prefill_with_aging() -> None:
    schedule = Schedule(4, 256, 512, 1 << 30, 1)
    for n in (5000, 10, 0, 300):
        schedule.add(_job([1] * max(n, 1)))
    slots = schedule.admit()
    for slot, left in zip(slots, (5000, 10, 0, 300), strict=True):
        slot.task = FakeTask(left)
    picks: list[int] = []
    for _ in range(2 * (AGE_LIMIT + 3)):
        slot = schedule.pick()
        picks.append(slots.index(slot))
        assert slot.task is not None
        slot.task.step(Decision(256, False))
        schedule.ran(slot)
    # the short prompt one pass from its first token first, then decoding (the job that
    # was decoding, then that one in turn), before the longer prefills, which wait at most
    # AGE_LIMIT + max_active - 1 passes of others
    assert picks[:4] == [1, 2, 1, 2]
    runs = [k for k, p in enumerate(picks) if p == 0]
    gaps = [b - a - 1 for a, b in zip([-1, *runs[:-1]], runs, strict=True)]
    assert gaps and max(gaps) <= AGE_LIMIT + 3
    assert schedule.pass_tokens() == 256


def test_a_turn_whose_conversation_the_cache_holds_ranks_with_short_prompts() -> None:
    """An agent's next turn is a long prompt whose conversation the cache holds: one pass from
    its first token, it goes before decode steps, as a short prompt does (four sub-agents'
    second turns then reach their first tokens together, and decode in one batch); a long
    prompt's own last slice does not."""
    turn, long, decoding = _job([1] * 3000), _job([2] * 4000), _job([3] * 20)
    schedule = Schedule(4, 256, 512, 1 << 30, 1,
                        cached=lambda job: 2950 if job is turn else 0)
    for job in (long, decoding, turn):
        schedule.add(job)
    slots = schedule.admit()
    slots[0].task, slots[1].task = FakeTask(100), FakeTask(0)   # a last slice; decoding
    assert schedule.pick() is slots[2]          # the turn: 50 tokens left of 3,000
    slots[2].task = FakeTask(50)
    assert schedule.pick() is slots[2]
    slots[2].task.step(Decision(256, False))
    schedule.ran(slots[2])
    # both decode (in one pass) before the long prompt's last slice
    assert set(schedule.decoding(schedule.pick())) == {slots[1], slots[2]}


def test_a_prefix_already_computed_by_a_running_job_is_waited_for_as_long_as_computing_it(
        ) -> None:
    """A sub-agent arriving after another computed their shared prompt (it is decoding) has
    that one store it from its live state; where it cannot (a recurrent model with no
    checkpoint below it: its state is stored when it ends), it waits for that end rather than
    compute the prompt again, but no longer than computing it would take at the worker's
    prefill rate."""
    shared = [7] * 2000
    first, late = _job([*shared, 1]), _job([*shared, 2, 3])
    schedule = Schedule(4, 256, 512, 1 << 30, 1, prefill_rate=lambda: 1000.0)
    schedule.add(first)
    (a,) = schedule.admit()
    a.task = FakeTask(0)                        # decoding: past the shared prompt
    schedule.add(late)
    (b,) = schedule.admit()
    assert schedule.pick() is a and schedule.share(a) == 0   # b waits; no pass to cut
    assert schedule.due == [(a, 2000)]          # a stores it from its live state first
    schedule.stored(a, 2000, 0)                 # ... but could not (FakeTask.publish)
    assert schedule.pick() is a and schedule.due == []   # tried once
    schedule.ran(a, 1.5)                        # 1.5 s of a's passes: under 2,000 / 1,000 s
    assert schedule.pick() is a
    assert b in schedule.held
    schedule.ran(a, 0.6)                        # 2.1 s: computing it would have been sooner
    schedule.pick()
    assert b not in schedule.held               # free to run (in its turn)


def test_a_prefix_a_running_job_stored_from_its_live_state_is_restored_not_waited_for(
        ) -> None:
    shared = [7] * 2000
    first, late = _job([*shared, 1]), _job([*shared, 2, 3])
    held = [0]
    schedule = Schedule(4, 256, 512, 1 << 30, 1, prefill_rate=lambda: 1000.0,
                        cached=lambda job: held[0] if job is late else 0)
    schedule.add(first)
    (a,) = schedule.admit()
    a.task = FakeTask(0)
    schedule.add(late)
    (b,) = schedule.admit()
    assert schedule.pick() is a and schedule.due == [(a, 2000)]
    held[0] = 2000                              # what a's publish stored
    schedule.stored(a, 2000, 2000)
    assert schedule.pick() is b and b not in schedule.held and schedule.due == []
    assert b.remaining() == 2                   # its own tail only


def test_aging_by_time_lets_cheap_decode_steps_run_before_an_expensive_slice() -> None:
    """With slices sized by time, aging is too: a long prefill waits AGE_LIMIT slices' time
    (not AGE_LIMIT passes) of others' passes, so twenty 40 ms decode steps do not make it
    preempt a short prompt's prefill; a second of passes at 250 ms each does."""
    schedule = Schedule(3, 256, 512, 1 << 30, 1, slice_ms=250, prefill_rate=lambda: 1000.0)
    for n in (5000, 0):
        schedule.add(_job([1] * max(n, 1)))
    long, decoding = schedule.admit()
    long.task, decoding.task = FakeTask(5000), FakeTask(0)
    for _ in range(20):                          # 0.8 s of decode steps
        assert schedule.pick() is decoding
        schedule.ran(decoding, 0.04)
    schedule.add(_job([1] * 60))
    (short,) = schedule.admit()
    short.task = FakeTask(60)
    assert schedule.pick() is short              # the long one is not aged yet
    schedule.ran(short, 1.25)                    # 2.05 s kept: AGE_LIMIT x 250 ms passed
    assert schedule.pick() is long


def test_a_pass_pauses_only_for_a_newcomer_in_a_better_class() -> None:
    """A short prompt that arrives during a long prefill pass pauses it; another long prompt
    does not, a pass chosen by aging never pauses, and a paused pass's own time does not reset
    its aging (so pauses cannot starve it)."""
    schedule = Schedule(4, 256, 512, 1 << 30, 1, slice_ms=250, prefill_rate=lambda: 1000.0)
    schedule.add(_job([1] * 5000))
    (long,) = schedule.admit()
    long.task = FakeTask(5000)
    assert schedule.pick() is long and not schedule.preempts(long, [])
    longer = _job([1] * 3000)                      # a longer prefill: same class, waits
    assert not schedule.preempts(long, [longer])
    schedule.add(longer)                           # admitted between two passes
    (other,) = schedule.admit()
    other.task = FakeTask(3000)
    short_job = _job([1] * 60)                     # a short prompt: one pass from its token
    assert schedule.preempts(long, [short_job])
    assert len(schedule.active) == 2 and not schedule.waiting   # asking admitted nobody
    schedule.add(short_job)
    (short,) = schedule.admit()
    short.task = FakeTask(60)
    schedule.ran(long, 0.3, paused=True, others=[other])
    assert long.kept == 0.0 and other.kept == 0.3 and short.kept == 0.0
    assert schedule.pick() is short
    schedule.ran(short, 2.0)                       # long and other kept 2 s: aged
    assert schedule.pick() is other and other.aged  # the longest kept first (2.3 s)
    schedule.ran(other, 0.1)
    assert schedule.pick() is long and long.aged   # its pauses did not reset its 2.1 s
    arriving = _job([1] * 50)
    assert not schedule.preempts(long, [arriving])  # an aged pass runs to its end
    schedule.add(arriving)
    (newcomer,) = schedule.admit()
    newcomer.task = FakeTask(50)
    newcomer.job.cancel()
    assert schedule.pick() is newcomer             # a job whose client left ends first


def test_a_deep_prompts_last_slice_is_not_a_short_prompt() -> None:
    """Only a short prompt ranks as one pass from its first token: a long prompt's last
    tokens are a slice deep in it (slow), which waits behind decode steps like its other
    slices, and pauses for a short prompt that arrives."""
    schedule = Schedule(3, 256, 512, 1 << 30, 1)
    for n in (8000, 1):
        schedule.add(_job([1] * n))
    deep, decoding = schedule.admit()
    deep.task, decoding.task = FakeTask(100), FakeTask(0)
    assert schedule.pick() is decoding
    schedule.remove(decoding)
    assert schedule.pick() is deep
    arriving = _job([1] * 40)
    assert schedule.preempts(deep, [arriving])


def test_a_follow_up_ranks_by_the_tokens_its_cache_lacks() -> None:
    """Least remaining prefill first counts what the worker's cache holds: a follow-up turn
    of a long conversation (300 new tokens) goes before a fresh 1,500-token prompt."""
    schedule = Schedule(3, 256, 512, 1 << 30, 1,
                        cached=lambda job: 7800 if len(job.prompt.tokens) == 8100 else 0)
    for n in (1500, 8100):
        schedule.add(_job([1] * n))
    fresh, follow_up = schedule.admit()
    assert (fresh.remaining(), follow_up.remaining()) == (1500, 300)
    assert schedule.pick() is follow_up


def test_the_engines_estimate_is_what_a_restore_reuses(model: CountingModel) -> None:
    rng = random.Random(30)
    first = _words(rng, 200)
    engine = Engine(model, _settings())
    _run(engine, first, BOUNDS)
    follow = first + _words(rng, 30)
    used = [e.last_used for e in engine.store.entries]
    estimate = engine.cached_now(follow)
    assert [e.last_used for e in engine.store.entries] == used    # nothing marked used
    assert engine.cached_now(follow, namespace="other") == 0
    assert estimate > 0 and _run(engine, follow, BOUNDS)[2].cached_tokens == estimate


def test_admission_counts_live_cache_bytes() -> None:
    schedule = Schedule(4, 256, 512, 1000, 10)   # 100 tokens of live cache
    for n in (80, 30, 10):
        schedule.add(_job([1] * n))
    # (80 + 4) x 10 = 840 bytes; 30's 340 would not fit beside it, 10's 140 does (a job that
    # does not fit is passed by one behind it that does)
    assert [len(s.job.prompt.tokens) for s in schedule.admit()] == [80, 10]
    assert [len(j.prompt.tokens) for j in schedule.waiting] == [30]
    schedule.remove(schedule.active[0])
    assert [len(s.job.prompt.tokens) for s in schedule.admit()] == [30]
    alone = Schedule(2, 256, 512, 10, 10)
    alone.add(_job([1] * 500))
    assert len(alone.admit()) == 1   # one job alone always runs
    assert alone.pass_tokens() == 512


def test_admission_counts_the_reply_too() -> None:
    """A job's live cache grows by its reply: max_tokens counts against the budget."""
    schedule = Schedule(4, 256, 512, 1000, 10)
    schedule.add(_job([1] * 40))                   # (40 + 4) x 10 = 440 bytes
    schedule.add(_job([1] * 10, max_tokens=60))    # (10 + 60) x 10 = 700: 1,140 > 1,000
    assert [len(s.job.prompt.tokens) for s in schedule.admit()] == [40]
    schedule.remove(schedule.active[0])
    assert [len(s.job.prompt.tokens) for s in schedule.admit()] == [10]


def test_a_slice_is_its_time_at_the_measured_prefill_rate() -> None:
    rate: list[float | None] = [None]
    schedule = Schedule(2, 96, 512, 1 << 30, 1, slice_ms=250, prefill_rate=lambda: rate[0])
    schedule.add(_job([1] * 4000))
    (slot,) = schedule.admit()
    assert schedule.pass_tokens(slot) == 96              # no rate measured yet: prefill_slice
    for tps, tokens in ((1000.0, 250), (400.0, 100), (20.0, MIN_SLICE), (1e6, 512)):
        rate[0] = tps                              # the worker's rate (alone too)
        assert schedule.pass_tokens(slot) == tokens, tps
    slot.task = FakeTask(3000, rate=50.0)          # its own last pass: 50 tokens/s, deep in
    assert schedule.pass_tokens(slot) == MIN_SLICE       # its prompt: 12.5 tokens -> the floor
    slot.task = FakeTask(3000, rate=800.0)
    assert schedule.pass_tokens(slot) == 200
    slot.task = FakeTask(90, rate=50.0)            # the long prompt's last 90 tokens: deep,
    assert schedule.pass_tokens(slot) == MIN_SLICE       # so by time
    schedule.add(_job([1] * 90))
    (short,) = schedule.admit()
    short.task = FakeTask(90)                      # a short prompt's rest: one pass, however
    assert schedule.pass_tokens(short) == 96             # slow the passes deep in another prompt
    fixed = Schedule(2, 96, 512, 1 << 30, 1, slice_ms=0, prefill_rate=lambda: 1000.0)
    fixed.add(_job([1] * 4000))
    assert fixed.pass_tokens() == 512                    # prefill_slice_ms 0: whole chunks alone,
    fixed.add(_job([1] * 10))
    assert fixed.pass_tokens() == 96                     # token slices while others wait


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Callable[[str], Any]) -> Any:
    """The tiny models' tokenizer (their vocabulary), as the worker loads it."""
    from mlx_lm.tokenizer_utils import load
    return load(tiny_model_dir("qwen3"))


@pytest.fixture(scope="module", params=["qwen3", "gemma3_text", "qwen3_next", "qwen3_5",
                                        "falcon_h1"])
def model(request: pytest.FixtureRequest) -> Any:
    from prefixd.backends.mlx.model.tiny import build_model
    return CountingModel(build_model(request.param, seed=3))


def test_admission_counts_what_a_request_holds_besides_its_kv() -> None:
    """A hybrid's request holds fixed-size states whatever its length: counted per job."""
    schedule = Schedule(8, 256, 512, 1000, 1, per_request=300)
    for _ in range(5):
        schedule.add(_job([1] * 10))             # (10 + 4) x 1 + 300 = 314 bytes each
    assert len(schedule.admit()) == 3              # 4 x 314 > 1,000


def test_a_requests_fixed_bytes_are_its_states_and_its_logits() -> None:
    """qwen3_next's tiny config: 3 Gated-DeltaNet layers, each a convolution state of
    (kernel - 1) x (2 x 2 x 16 + 4 x 16) float32 and a recurrent state of 4 x 16 x 16
    float32; held twice where a verify pass or a decode pass launched ahead keeps the state
    before it to go back; plus a verify pass's logits and draws. Full attention holds no
    fixed state."""
    hybrid = Engine(model_from_config(tiny_config("qwen3_next")), EngineConfig())
    states = 3 * (3 * (2 * 2 * 16 + 4 * 16) * 4 + 4 * 16 * 16 * 4)
    leaves = hybrid.reference_leaves()
    assert hybrid.logits_bytes == 1024 * 4
    assert request_bytes(leaves, 4096, 9, False) == states + 2 * 9 * 4096
    assert request_bytes(leaves, 4096, 9, True) == 2 * states + 2 * 9 * 4096
    # a decode pass launched ahead keeps the states before it, and its own logits beside the
    # step's
    assert request_bytes(leaves, 4096, 1, False, ahead=True) == 2 * states + 2 * 2 * 4096
    assert request_bytes(leaves, 4096, 9, True, ahead=True) == 2 * states + 2 * 9 * 4096
    plain = Engine(model_from_config(tiny_config("qwen3")), EngineConfig())
    assert request_bytes(plain.reference_leaves(), 4096, 1, False) == 2 * 4096
    assert request_bytes(plain.reference_leaves(), 4096, 1, False, ahead=True) == 4 * 4096


def _started(slot: Any, length: int) -> Any:
    """`slot` decoding, its live cache `length` tokens."""
    slot.task = FakeTask(0, length=length)
    return slot


def test_a_short_job_is_admitted_beside_a_long_answer_and_not_padded_to_it() -> None:
    """A long answer taking over half the budget: a short newcomer runs beside it (before, a
    decode batch padding its row to the long one's counted it twice the long one: it waited
    for the whole answer), in passes of its own while the padded copy would not fit."""
    schedule = Schedule(4, 256, 512, 1000, 1)
    schedule.add(_job([1] * 100, max_tokens=500))       # 600 bytes reserved
    (long,) = schedule.admit()
    _started(long, 400)
    schedule.add(_job([1] * 10, max_tokens=8))          # 18: 618 <= 1,000
    (short,) = schedule.admit()
    assert not short.borrows
    _started(short, 12)
    assert schedule.decoding(short) == [long, short]    # padded: 2 x 400 <= 1,000
    _started(long, 520)
    assert schedule.decoding(short) == [short]          # padded: 2 x 520 > 1,000
    assert schedule.decoding(long) == [long]
    roomy = Schedule(4, 256, 512, 10_000, 1)            # room for the padded copy: one pass
    for job in (long.job, short.job):
        roomy.add(job)
    a, b = roomy.admit()
    _started(a, 400), _started(b, 12)
    assert roomy.decoding(b) == [a, b]


def test_a_long_answer_pauses_for_a_short_job_borrowing_its_room() -> None:
    """A long answer reserved past the budget (alone, as one job always runs: the budget is
    its reservation while it runs): a short job borrows the room it leaves now, even once it
    holds more than the budget; the long one is held while its next step would eat into the
    short one's reservation, and runs again when it ends. A second long answer never borrows
    in place of the first."""
    schedule = Schedule(4, 256, 512, 1000, 1)
    schedule.add(_job([1] * 100, max_tokens=1400))      # 1,500 bytes: alone only
    (long,) = schedule.admit()
    assert long.alone
    _started(long, 1100)                                # past the budget, within its own
    schedule.add(_job([1] * 100, max_tokens=1400))      # as long: waits
    schedule.add(_job([1] * 10, max_tokens=200))        # 210 <= 1,500 - 1,100
    (short,) = schedule.admit()
    assert short.borrows and len(schedule.waiting) == 1
    _started(short, 10)
    schedule.pick()
    assert not schedule.waits                           # 1,100 + 210 + 1 <= 1,500: no hold
    _started(long, 1290)                                # 1,290 + 210 + 1 > 1,500
    for _ in range(3):
        assert schedule.pick() is short and schedule.waits == {long}
        schedule.ran(short)
    assert schedule.decoding(short) == [short]
    schedule.remove(short)
    assert schedule.pick() is long and not schedule.waits
    assert not schedule.admit()                         # the second long one still waits


def test_nobody_borrows_while_a_held_job_has_aged() -> None:
    """A long prefill held for a borrower's room (its next slice would eat into it): once it
    has waited its aging limit, newcomers that would fit beside what the others hold wait
    too, so it runs as soon as the borrowers end."""
    schedule = Schedule(4, 256, 512, 1000, 1)
    schedule.add(_job([1] * 1000))                      # 1,004 bytes: alone only
    (long,) = schedule.admit()
    long.task = FakeTask(300, length=700)               # prefilling, 700 in its live cache
    schedule.add(_job([1] * 10, max_tokens=150))        # 700 + 160 <= 1,004
    (short,) = schedule.admit()
    _started(short, 10)
    for _ in range(AGE_LIMIT):                          # 700 + 160 + a 256-token slice
        assert schedule.pick() is short and schedule.waits == {long}
        schedule.ran(short)
    schedule.add(_job([1] * 5, max_tokens=5))           # 10 bytes: would fit beside them,
    assert not schedule.admit()                         # but the held one has waited enough
    schedule.remove(short)
    assert schedule.pick() is long
    schedule.ran(long)
    assert len(schedule.admit()) == 1                   # it ran: borrowing again


def test_a_job_that_does_not_fit_is_passed_at_most_pass_limit_times() -> None:
    from prefixd.backends.mlx.scheduler.policy.room import PASS_LIMIT

    schedule = Schedule(64, 256, 512, 1000, 1)
    schedule.add(_job([1] * 100, max_tokens=500))
    schedule.admit()
    schedule.add(_job([1] * 100, max_tokens=500))      # 600 + 600 > 1,000: waits
    admitted = 0
    for _ in range(PASS_LIMIT + 3):
        schedule.add(_job([1] * 2, max_tokens=2))
        admitted += len(schedule.admit())
    assert admitted == PASS_LIMIT
    assert len(schedule.waiting[0].prompt.tokens) == 100
