"""An Engine driven as the worker's scheduler drives it: `Engine.steps`, one typed step per
forward pass (`engine/pacing.py`), each pass sized by the request's `Plan` (a whole
`prefill_chunk` here: a job alone with max_active 1). The tests of the Engine go through this,
the same generator `scheduler/active.py` runs; what is sent into `generate` (a decode batch's
`Fed`, `Batch.step`) goes on into the Engine's steps."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

from prefixd.backends.mlx.engine.engine import Engine, Turn
from prefixd.backends.mlx.engine.pacing import Pacing, Sent, resume


def turn_for(engine: Engine) -> Turn:
    return Turn(Pacing())


def generate(engine: Engine, prompt: list[int], *, sampler: Callable[[Any], Any],
             max_tokens: int, boundaries: Sequence[int] = (),
             should_stop: Callable[[], bool] = lambda: False, namespace: str = "",
             turn: Turn | None = None, logits_processors: list | None = None
             ) -> Generator[int, Sent, None]:
    """The sampled tokens (closing it ends the request, as a stop string does); `turn` gets
    the request's stats."""
    steps = engine.steps(prompt, sampler=sampler, logits_processors=logits_processors,
                         max_tokens=max_tokens, boundaries=boundaries, should_stop=should_stop,
                         namespace=namespace, turn=turn or turn_for(engine))
    try:
        sent: Sent = None
        while (step := resume(steps, sent)) is not None:
            sent = (yield step) if isinstance(step, int) else None
    finally:
        steps.close()
