"""Jobs waiting for a prefix another job computes (the policy half of a shared prefix, pure):
a job not started yet whose prompt shares at least `SHARE_MIN` tokens (past what the cache
holds of it) with a started job's waits for that job to reach the prefix and restores it,
instead of computing it beside it; the started job publishes its state there (`share`: a pass
ends at that position) or, already past it, stores it from its live state before the next
pass (`due`). A mixin of `schedule.Schedule` (its state: the schedule's own).
"""

from __future__ import annotations

from collections.abc import Callable

from prefixd.backends.mlx.cache.placement import common_prefix
from prefixd.backends.mlx.scheduler.jobs import Job
from prefixd.backends.mlx.scheduler.policy.slots import Slot

SHARE_MIN = 256  # tokens of a prefix being computed worth waiting for instead of computing it


class Sharing:
    """Who waits for whose prefix, and where it is published (the Schedule's)."""

    active: list[Slot]
    held: dict[Slot, tuple[Slot, int]]
    due: list[tuple[Slot, int]]
    _tried: set[tuple[int, int]]
    _shared: dict[tuple[int, int], int]
    rate: Callable[[], float | None]
    _estimate: Callable[[Job], int]
    changed: Callable[[], None]

    def published(self, slot: Slot) -> None:
        """After `slot`'s pass: if it reached the position it was to publish, the store holds
        that prefix now (for the jobs waiting, and for itself: its own last pass is then as
        short as theirs, and ranks with them)."""
        at = self.share(slot)
        if at and len(slot.job.prompt.tokens) - slot.remaining() >= at:
            slot.cached = max(slot.cached, at)
            self.changed()

    def stored(self, slot: Slot, at: int, tokens: int | None) -> None:
        """`slot` (started, past `at`) stored `tokens` of its prompt for the jobs waiting for
        its first `at` (`due`): tried once (None: it could not yet, a pass of it half done)."""
        if tokens is None:
            return
        self._tried.add((id(slot.job), at))
        if tokens:
            self.changed()

    def share(self, slot: Slot) -> int:
        """Where `slot`'s prefill publishes its state next for the jobs waiting for it (the
        nearest such position ahead; 0: none)."""
        return min((at for holder, at in self.held.values() if holder is slot and at),
                   default=0)

    def _holder(self, slot: Slot) -> tuple[Slot, int] | None:
        """A job not started yet waits for a started one that shares a long prefix of its
        prompt (at least `SHARE_MIN` tokens past what the cache holds of it), and restores it
        instead of computing it beside it: (that job, the position it publishes it at, when
        its prefill has not reached it yet, `share`; else 0: that job stores it from its live
        state before the next pass (`due`), and should it not hold it (a recurrent model with
        no checkpoint near it), the state is stored when that job ends, and the job waits for
        that at most as long as computing the prefix would take, at the worker's prefill rate,
        or that job's before one is measured)."""
        if slot.task is not None or slot.job.cancelled:
            return None
        for other in self.active:
            if other.task is None or other.job.cancelled or \
                    other.job.namespace != slot.job.namespace:
                continue
            mine, theirs = slot.job.prompt.tokens, other.job.prompt.tokens
            at = min(self._common(slot.job, other.job), len(mine) - 1, len(theirs) - 1)
            if at < SHARE_MIN or at - self._estimate(slot.job) < SHARE_MIN:
                continue
            if len(theirs) - other.remaining() < at:
                return other, at
            if (id(other.job), at) not in self._tried and (other, at) not in self.due:
                self.due.append((other, at))
            rate = self.rate() or other.task.pass_rate()   # the worker's, or that job's
            if rate and slot.kept < (at - self._estimate(slot.job)) / rate:
                return other, 0
        return None

    def _common(self, a: Job, b: Job) -> int:
        key = (min(id(a), id(b)), max(id(a), id(b)))
        if key not in self._shared:
            self._shared[key] = common_prefix(a.prompt.tokens, b.prompt.tokens)
        return self._shared[key]
