"""An admitted job as the scheduler sees it (`Slot`), and what it asks of the job's passes
(`Task`: `active.Active` runs them).

Owns: nothing but these types; `schedule.Schedule` owns the slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prefixd.backends.mlx.scheduler.jobs import Job
from prefixd.backends.mlx.scheduler.policy.steps import Decision, Step

# The decode steps of several jobs' tasks in one pass, given each one's `Decision.stop`.
Batched = Callable[[list["Task"], list[bool]], list[Step]]


class Task(Protocol):
    """One admitted job's passes (`active.Active`)."""

    def remaining(self) -> int:
        """Prompt tokens still to prefill (0 once decoding)."""
        ...

    def ready(self) -> bool:
        """Whether its prefill waits for its prompt's last token, which a decode pass of
        the decoding jobs can feed as one of its rows."""
        ...

    def pass_rate(self) -> float | None:
        """Tokens per second of its last prefill pass (None before its first)."""
        ...

    def length(self) -> int:
        """Tokens its live cache holds now (prompt prefilled, reply so far)."""
        ...

    def step(self, decision: Decision) -> Step:
        """One forward pass, or its part up to a pause (never raises)."""
        ...

    def publish(self, at: int) -> int | None:
        """Store its prompt's state at `at` from its live state, its prefill being past it
        (or at the nearest position below it the worker can rebuild): the tokens stored,
        None while a pass of it is half done (never raises)."""
        ...


@dataclass(eq=False)
class Slot:
    """An admitted job: its reservation (the most its live cache can reach), its task once
    started, its aging."""

    job: Job
    kv_bytes: int
    borrows: bool = False   # admitted on the room the others leave now (`room.py`)
    alone: bool = False     # admitted alone past the budget: the budget is its while it runs
    task: Task | None = None
    last: int = 0      # the tick of its last pass
    skipped: int = 0   # other jobs' passes since its last
    kept: float = 0.0  # seconds of other jobs' passes since its last
    aged: bool = False  # picked by aging: its pass runs to its end (never pauses)
    cached: int = 0     # its prompt tokens the worker's cache holds (as of when it started)
    regrouped: bool = False   # its first pass was taken back: it may share a prefill pass

    def remaining(self) -> int:
        """Prompt tokens still to prefill: before it starts, those its cache estimate leaves."""
        return self.task.remaining() if self.task else len(self.job.prompt.tokens) - self.cached
