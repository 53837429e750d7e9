"""An Engine driven as the worker's scheduler drives it (`scheduler/active.py`): `Engine.begin`
(the restore), `Engine.steps_of` (one typed step per forward pass, `engine/pacing.py`, each pass
sized by the request's `Plan`: a whole `prefill_chunk` here, a job alone with max_active 1),
then `Engine.end` (the commit) on any exit. The tests of the Engine go through this; what is
sent into `turn_steps` or `generate` (a new `Plan`, a decode batch's `Fed`, `Batch.step`) goes
on into the Engine's steps."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

from prefixd.backends.mlx.engine.engine import Engine, Turn
from prefixd.backends.mlx.engine.pacing import Pacing, Plan, Sent, resume
from prefixd.backends.mlx.engine.run import Step


def turn_for(engine: Engine) -> Turn:
    return Turn(Pacing())


def turn_steps(engine: Engine, prompt: list[int], *, sampler: Callable[[Any], Any],
               max_tokens: int, boundaries: Sequence[int] = (),
               should_stop: Callable[[], bool] = lambda: False, namespace: str = "",
               turn: Turn | None = None, logits_processors: list | None = None,
               plan: Plan | None = None) -> Generator[Step, Sent, None]:
    """A request's whole turn, every typed step: begun now, ended on any exit."""
    turn = turn or turn_for(engine)
    engine.begin(prompt, sampler=sampler, logits_processors=logits_processors,
                 max_tokens=max_tokens, should_stop=should_stop, namespace=namespace, turn=turn)
    steps = engine.steps_of(turn, boundaries, plan or Plan(engine.config.prefill_chunk))
    try:
        sent: Sent = None
        while (step := resume(steps, sent)) is not None:
            sent = yield step
    finally:
        steps.close()
        engine.end(turn)


def generate(engine: Engine, prompt: list[int], *, sampler: Callable[[Any], Any],
             max_tokens: int, boundaries: Sequence[int] = (),
             should_stop: Callable[[], bool] = lambda: False, namespace: str = "",
             turn: Turn | None = None, logits_processors: list | None = None
             ) -> Generator[int, Sent, None]:
    """The sampled tokens (closing it ends the request, as a stop string does); `turn` gets
    the request's stats."""
    steps = turn_steps(engine, prompt, sampler=sampler, max_tokens=max_tokens,
                       boundaries=boundaries, should_stop=should_stop, namespace=namespace,
                       turn=turn, logits_processors=logits_processors)
    try:
        sent: Sent = None
        while (step := resume(steps, sent)) is not None:
            sent = (yield step) if isinstance(step, int) else None
    finally:
        steps.close()
