"""The typed steps of a generation and what paces them: pure, no mlx.

A step of `Engine.steps_of` is one forward pass: `Prefilled` (a prefill pass ended), `Paused` (a
prefill pass stopped between two layers; the next step resumes it; `Regrouped`: a first pass
taken back, to run with company), or the token a decode step sampled. Each step goes in with
what it runs on, sent into the generator as it resumes: the scheduler's `Plan` for a pass of
the request's own (its size, decided in one place, `Schedule.pass_tokens`), or what a decode
batch's pass left for it (`live.fed.Fed`). Its `Pacing` (whether a pass under way pauses, whether a
first pass is taken back) is fixed for the turn; the request's `engine.Turn` holds it, its
stats, store entry and live state.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from prefixd.backends.mlx.engine.live.fed import Fed


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


@dataclass(frozen=True)
class Plan:
    """What the scheduler decided for a request's next step of its own (`Schedule.pass_tokens`):
    the size in tokens of its next prefill pass, a prompt position other requests wait for
    (`share`: a pass ends there and the state is published; 0: none), and whether that pass
    may pause between two layers for a newcomer. It goes in with the step: sent into the
    request's steps as they resume (`Engine.steps_of`; a resume with nothing sent keeps the last
    plan), read as each pass starts."""

    tokens: int
    share: int = 0
    pausable: bool = True   # False: no newcomer can outrank it, so the pass is evaluated whole


Sent = Plan | Fed | None   # what a request's steps are resumed with


@dataclass(frozen=True)
class Pacing:
    """What the scheduler may ask of a request's passes while they run, fixed for its turn:
    whether a pass under way pauses between two layers (`preempt`, asked after each; None:
    never), and whether a first prefill pass is taken back in its first layers, to run again
    with company (`regroup`: how many jobs arrived since that would share it, 0: none; asked
    after its 1st, 2nd, 4th ... layer, `Run._regroups`; None: never)."""

    preempt: Callable[[], bool] | None = None
    regroup: Callable[[], int] | None = None


def resume(steps: Generator[Any, Sent, Any], sent: Sent = None) -> Any:
    """The next step of `steps`, resumed with `sent` (None where nothing is sent, or to start
    it); None once it ended."""
    try:
        return next(steps) if sent is None else steps.send(sent)
    except StopIteration:
        return None
