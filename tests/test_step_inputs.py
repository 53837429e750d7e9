"""What each step of a request runs on goes in with the step (`engine/pacing.py`): the `Plan`
that sizes its prefill passes is sent into its steps as they resume, and what a decode batch's
pass left for a member (`Fed`: its row's logits and the token drawn from them) is returned by
the pass and sent in the same way; nothing is left on the run for its steps to find. The
restore (`Engine.begin`) and the commit (`Engine.end`) are not steps. On the real Engine and
a tiny model; replies equal the same prompts' alone and cold."""

from __future__ import annotations

import random

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from prefixd.backends.mlx.engine.config import EngineConfig
from prefixd.backends.mlx.engine.engine import Engine, Turn
from prefixd.backends.mlx.engine.pacing import Pacing, Plan, Prefilled, Ready
from prefixd.backends.mlx.model.tiny import build_model
from tests.engine_steps import generate, turn_for, turn_steps


def _engine() -> Engine:
    # checkpoints far apart: no mark cuts a pass, only the plans size them
    return Engine(build_model("qwen3", seed=7), EngineConfig(checkpoint_interval=4096,
                                                            prefill_chunk=64))


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def test_each_prefill_pass_is_the_size_of_the_plan_sent_in_with_its_step() -> None:
    engine, prompt = _engine(), _prompt(1, 41)
    steps = turn_steps(engine, prompt, sampler=greedy_sampler, max_tokens=4, plan=Plan(8))
    passes = [next(steps), steps.send(Plan(16)), steps.send(Plan(5))]
    rest = list(steps)   # nothing sent: the last plan stands
    passes += [s for s in rest if not isinstance(s, int)]
    # 8 + 16 + 5 + 5 + 5 tokens, the 40th alone (a pass ends where the prompt's last token
    # waits for a decode pass to carry it: `Ready`; none does here, so it runs its own)
    assert passes == [Prefilled(8), Prefilled(16), Prefilled(5), Prefilled(5), Prefilled(5),
                      Prefilled(1), Ready()]
    reply = [s for s in rest if isinstance(s, int)]
    assert reply == list(generate(_engine(), prompt, sampler=greedy_sampler, max_tokens=4))


def test_a_batch_pass_returns_what_it_left_each_member_and_its_steps_draw_that() -> None:
    engine = _engine()
    prompts = [_prompt(10 + i, 20 + 7 * i) for i in range(3)]
    turns = [Turn(Pacing()) for _ in prompts]
    gens = [generate(engine, p, sampler=greedy_sampler, max_tokens=8, turn=t)
            for p, t in zip(prompts, turns, strict=True)]
    replies = [[next(g)] for g in gens]
    for _ in range(7):
        left = engine.batch.step([t.run for t in turns if t.run is not None])
        assert len(left) == 3 and all(f.logits is not None and f.drawn is not None
                                      for f in left)
        for g, f, reply in zip(gens, left, replies, strict=True):
            token = g.send(f)
            assert token == int(mx.array(f.drawn).item())   # the token the pass drew for it
            reply.append(token)
    for g in gens:
        g.close()
    for p, reply in zip(prompts, replies, strict=True):
        assert reply == list(generate(_engine(), p, sampler=greedy_sampler, max_tokens=8))


def test_the_restore_and_the_commit_are_not_steps() -> None:
    """`Engine.begin` restores and runs no pass; the steps are the passes alone (their end
    commits nothing); `Engine.end`, which the scheduler calls on any exit, commits."""
    engine, prompt = _engine(), _prompt(3, 30)
    turn = turn_for(engine)
    run = engine.begin(prompt, sampler=greedy_sampler, max_tokens=5, turn=turn)
    assert (run.pos, run.fed, engine.passes.passes["prefill"]) == (0, [], 0)
    steps = list(engine.steps_of(turn, (), Plan(64)))
    reply = [s for s in steps if isinstance(s, int)]
    assert len(reply) == 5 and not run.ended
    follow = [*prompt, *reply, 5]
    assert engine.cached_now(follow) == 0
    engine.end(turn)
    assert run.ended and engine.cached_now(follow) == len(prompt) + len(reply)
