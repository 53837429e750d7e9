"""The scheduler's step protocol: pure, no mlx.

Before each step of a job the scheduler takes a `Decision` (its prefill pass size, whether it
stops); the step returns what happened, typed: `Prefilled` (a prefill pass ended), `Ready`
(the prompt is in but its last token, which a decode pass may carry), `Paused`
(one stopped between two layers, to resume at the next step), `Decoded` (a token sampled),
or the job's end, `Finished` / `Failed` (its last event).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixd.backends.mlx.engine.pacing import Paused, Prefilled, Ready, Regrouped
from prefixd.backends.mlx.scheduler.jobs import Failed, Finished

__all__ = ["Decision", "Decoded", "Failed", "Finished", "Paused", "Prefilled", "Ready",
           "Regrouped", "Step"]


@dataclass(frozen=True)
class Decision:
    """What a step runs on, decided before it: a prefill pass of at most `tokens`, whether
    the job stops (its client left) before it, and a position of its prompt that jobs waiting
    for it share (`share`: a pass ends there and the state is stored at once, 0: none)."""

    tokens: int
    stop: bool
    share: int = 0   # publish the prompt's state at this position (others wait for it)
    pausable: bool = True   # its pass may pause between two layers for a newcomer


@dataclass(frozen=True)
class Decoded:
    """A decode step sampled a token (the `n`th of the reply)."""

    n: int


Step = Prefilled | Ready | Paused | Decoded | Finished | Failed
