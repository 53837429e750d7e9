"""The typed steps of a generation and what paces them: pure, no mlx.

A step of `Engine.steps` is one forward pass: `Prefilled` (a prefill pass ended), `Paused` (a
prefill pass stopped between two layers; the next step resumes it; `Regrouped`: a first pass
taken back, to run with company), or the token a decode step sampled. Before each step its
caller sets the `Pacing`: the next pass's size (decided in one place, the scheduler's
`Schedule.pass_tokens`) and whether a pass pauses for another job; the request's `engine.Turn`
holds its pacing, stats, store entry and live state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Prefilled:
    """A prefill pass ran to its end: `tokens` more prompt tokens are in the live cache."""

    tokens: int


@dataclass(frozen=True)
class Ready:
    """The prompt is in the live cache but its last token, which waits as the run's `pending`
    token: the next step feeds it, in a decode pass beside the requests decoding (a row of
    the batch's, `engine/batch/executor.py`) or, when none is, in a pass of its own. Either
    way its logits give the first token."""


@dataclass(frozen=True)
class Paused:
    """A prefill pass stopped after evaluating cache leaf `layer` (of `layers`); the next step
    resumes it there."""

    layer: int
    layers: int


@dataclass(frozen=True)
class Regrouped(Paused):
    """A request's first prefill pass was taken back in its first layers (its cache as it was
    before): requests that arrived meanwhile share its prompt's pass instead
    (`engine/batch/prefill.py`). The next step runs the prefill again, unless a shared pass
    ran it first."""


@dataclass
class Pacing:
    """What the caller decides before each step: the next prefill pass's size in tokens,
    whether a pass under way pauses between two layers (asked after each; None: never), and
    whether a first prefill pass is taken back in its first layers, to run again with company
    (`regroup`: how many jobs arrived since that would share it, 0: none; asked after its
    1st, 2nd, 4th ... layer, `Run._regroups`; None: never)."""

    tokens: int
    preempt: Callable[[], bool] | None = None
    share: int = 0   # a prompt position other requests wait for: a pass ends there, published
    pausable: bool = True   # False: no newcomer can outrank it, so the pass is evaluated whole
    regroup: Callable[[], int] | None = None

