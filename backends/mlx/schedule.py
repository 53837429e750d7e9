"""The worker's scheduler: with `max_active` > 1, several jobs are under way on the one
generation thread, and it runs exactly one forward pass at a time (issue 26).

Owns: which waiting job is admitted (at most `max_active`, and only while the estimated live
caches of the admitted jobs fit `active_kv_bytes`: a job that does not fit waits; one job alone
is always admitted), which admitted job's pass runs next, and how many tokens a prefill pass
takes. Nothing here runs mlx: a job's passes are its `Task` (`generation.Active`, one
`Engine.steps` step each), and `Generator` owns starting and ending jobs.

Policy, between passes:
- the soonest first token, then least remaining prefill: a job one short pass from its first
  token (at most `prefill_slice` tokens left: a title call, a chat turn) runs first; then
  decoding jobs (0 left); then the other prefills, the shortest first. Ties go to the job that
  ran least recently (decode steps of running jobs are interleaved round-robin). So a short
  request that arrives waits for the pass under way and nothing else;
- aging: a job that other jobs' passes kept waiting `AGE_LIMIT` slices' time in a row
  (`AGE_LIMIT` x `prefill_slice_ms`: 2 s by default; with `prefill_slice_ms` 0, `AGE_LIMIT`
  passes) runs next, the longest kept first. So between two passes of an admitted job there
  are at most that much of other jobs' passes plus one pass of each other job (`max_active` -
  1 passes): nobody starves. Counted in time, a run of cheap decode steps does not age a long
  prefill as fast as its own expensive slices would;
- a prefill pass is a slice of about `prefill_slice_ms`: as many tokens as the job's own last
  pass ran in that time (its rate at its depth in the prompt, which falls as the prompt grows;
  the worker's measured prefill rate for its first pass; `prefill_slice` tokens before any is
  measured), at least `MIN_SLICE` tokens and at most `prefill_chunk`; a short prompt (at most
  `prefill_chunk` tokens, at most `prefill_slice` of them left) prefills the rest in one pass.
  Alone too: a request that arrives finds the pass under way at most one slice long, so its
  extra wait is about one slice, whatever the model, the machine and the depth of the prefill
  under way. With `prefill_slice_ms` 0, slices are `prefill_slice` tokens while others wait,
  whole chunks alone. A paused prefill keeps its live cache as it is (nothing is recomputed or
  copied), and its checkpoints land where they would unpaused (placement is by position,
  `run.Run.prefill_passes`);
- a cancelled job stops within one pass (its Engine generator commits what it computed);
- a job's time admitted but paused while other jobs' passes ran is its `paused_s`, reported
  beside its `queue_s` (time waiting to be admitted): together, its time behind others.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prefixd.backends.mlx.jobs import Job

AGE_LIMIT = 8  # passes of other jobs a job may be skipped in a row before it runs
MIN_SLICE = 32  # the smallest prefill slice, in tokens (smaller passes waste the device)


class Task(Protocol):
    """One admitted job's passes (`generation.Active`)."""

    def remaining(self) -> int:
        """Prompt tokens still to prefill (0 once decoding)."""
        ...

    def pass_rate(self) -> float | None:
        """Tokens per second of its last prefill pass (None before its first)."""
        ...

    def advance(self) -> bool:
        """One forward pass; True when the job has ended (its result is set, never raises)."""
        ...


@dataclass(eq=False)
class Slot:
    """An admitted job: its estimated live cache, its task once started, its aging."""

    job: Job
    kv_bytes: int
    task: Task | None = None
    last: int = 0      # the tick of its last pass
    skipped: int = 0   # other jobs' passes since its last
    kept: float = 0.0  # seconds of other jobs' passes since its last

    def remaining(self) -> int:
        return self.task.remaining() if self.task else len(self.job.prompt.tokens)


class Schedule:
    """Pure policy over waiting and admitted jobs (no threads, no mlx)."""

    def __init__(self, max_active: int, prefill_slice: int, prefill_chunk: int,
                 active_kv_bytes: int, kv_bytes_per_token: int, slice_ms: float = 0.0,
                 prefill_rate: Callable[[], float | None] = lambda: None) -> None:
        self.max_active, self.slice_tokens = max_active, min(prefill_slice, prefill_chunk)
        self.chunk, self.kv_budget, self.per_token = prefill_chunk, active_kv_bytes, \
            kv_bytes_per_token
        self.slice_ms, self.rate = slice_ms, prefill_rate
        self.waiting: deque[Job] = deque()
        self.active: list[Slot] = []
        self.tick = 0

    def idle(self) -> bool:
        return not self.waiting and not self.active

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def cancelled(self) -> list[Job]:
        """Waiting jobs whose client left (taken out; they end without running)."""
        gone = [j for j in self.waiting if j.cancelled]
        self.waiting = deque(j for j in self.waiting if not j.cancelled)
        return gone

    def admit(self) -> list[Slot]:
        """Admit waiting jobs in order while they fit (count and live-cache bytes)."""
        out: list[Slot] = []
        while self.waiting and len(self.active) < self.max_active:
            job = self.waiting[0]
            cost = (len(job.prompt.tokens) + job.max_tokens) * self.per_token
            used = sum(s.kv_bytes for s in self.active)
            if self.active and used + cost > self.kv_budget:
                break
            slot = Slot(self.waiting.popleft(), cost)
            self.active.append(slot)
            out.append(slot)
        return out

    def pick(self) -> Slot:
        """The admitted job whose pass runs next (see the module docstring)."""
        if self.slice_ms > 0:
            limit = AGE_LIMIT * self.slice_ms / 1000
            aged = [s for s in self.active if s.kept >= limit]
        else:
            aged = [s for s in self.active if s.skipped >= AGE_LIMIT]
        if aged:
            return max(aged, key=lambda s: (s.kept, s.skipped, -s.last))
        return min(self.active, key=self._rank)

    def _rank(self, s: Slot) -> tuple[int, int, int]:
        left = s.remaining()
        if 0 < left <= self.slice_tokens:
            return 0, left, s.last      # its next pass gives its first token
        return (1 if left == 0 else 2), left, s.last

    def ran(self, slot: Slot, seconds: float = 0.0) -> None:
        """`slot`'s pass ran, for `seconds`: the others were kept waiting that long."""
        self.tick += 1
        slot.last, slot.skipped, slot.kept = self.tick, 0, 0.0
        for s in self.active:
            if s is not slot:
                s.skipped += 1
                s.kept += seconds

    def slice(self, slot: Slot | None = None) -> int:
        """Tokens of `slot`'s next prefill pass (see the module docstring)."""
        if self.slice_ms <= 0:
            return self.slice_tokens if len(self.active) + len(self.waiting) > 1 else self.chunk
        if slot is not None and 0 < slot.remaining() <= self.slice_tokens and \
                len(slot.job.prompt.tokens) <= self.chunk:
            return self.slice_tokens    # a short prompt's prefill: one pass to its first token
        rate = slot.task.pass_rate() if slot is not None and slot.task is not None else None
        rate = rate or self.rate()
        if not rate:
            return self.slice_tokens
        return max(MIN_SLICE, min(self.chunk, int(rate * self.slice_ms / 1000)))

    def remove(self, slot: Slot) -> None:
        self.active.remove(slot)


def drive(schedule: Schedule, take: Callable[[bool], Sequence[Job] | None],
          start: Callable[[Job, Callable[[], int]], Task],
          end: Callable[[Job], None]) -> None:
    """Run jobs until none is admitted or waiting (on the generation thread). `take(idle)`:
    the jobs submitted since, or None to stop (only when `idle` and none was submitted: the
    caller decides that under its lock, so a job submitted then starts a new loop); `start`:
    a job's task (never raises); `end(job)`: a job cancelled while it waited."""
    while True:
        jobs = take(schedule.idle())
        if jobs is None:
            return
        for job in jobs:
            schedule.add(job)
        for job in schedule.cancelled():
            end(job)
        for slot in schedule.admit():
            slot.job.queue_s = time.perf_counter() - slot.job.submitted
        if not schedule.active:
            continue
        slot = schedule.pick()
        if slot.task is None:
            slot.task = start(slot.job, functools.partial(schedule.slice, slot))
        t0 = time.perf_counter()
        done = slot.task.advance()
        spent = time.perf_counter() - t0
        for other in schedule.active:
            if other is not slot:
                other.job.paused_s += spent
        schedule.ran(slot, spent)
        if done:
            schedule.remove(slot)


def kv_bytes_per_token(leaves: Sequence[Any]) -> int:
    """Rough live-cache bytes per token of a model, from its cache leaves after a pass: the
    keys and values of its attention layers (recurrent states are fixed-size; a sliding window
    is counted as if unbounded: an overestimate)."""
    total = 0
    for c in leaves:
        for arrays in (getattr(c, "keys", None), getattr(c, "values", None)):
            for a in arrays if isinstance(arrays, tuple) else (arrays,):
                if a is not None and getattr(a, "ndim", 0) == 4 and a.shape[2]:
                    total += a.nbytes // a.shape[2]
    return total
