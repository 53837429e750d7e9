"""The scheduler's loop on the generation thread: between two passes it takes the jobs
submitted since, admits them (`schedule.Schedule`), ends those cancelled while waiting, tells
the rest their place in line, picks the pass and runs it (one job's step, or the decode steps
of every decoding job in one pass), and ends the jobs whose pass was their last.

Owns: nothing between calls. The policy is `schedule.py`'s (pure); the jobs' tasks are
`active.py`'s; starting and ending jobs is `generator.py`'s.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

from prefixd.backends.mlx.scheduler.jobs import Job, Queued
from prefixd.backends.mlx.scheduler.policy.schedule import Schedule
from prefixd.backends.mlx.scheduler.policy.slots import Batched, Slot, Task
from prefixd.backends.mlx.scheduler.policy.steps import (
    Decision,
    Failed,
    Finished,
    Paused,
    Regrouped,
)


def drive(schedule: Schedule, take: Callable[[bool], Sequence[Job] | None],
          start: Callable[[Job, Callable[[], bool] | None, Callable[[], int] | None], Task],
          end: Callable[[Job, Finished | Failed], None],
          arrived: Callable[[], Sequence[Job]] = lambda: (),
          batch: Batched | None = None,
          prefill: Batched | None = None,
          report: Callable[[Schedule], None] = lambda schedule: None) -> None:
    """Run jobs until none is admitted or waiting (on the generation thread). Between two
    passes: `take(idle)`, the jobs submitted since, or None to stop (only when `idle` and none
    was submitted: the caller decides that under its lock, so a job submitted then starts a
    new loop); then admission, and the end of jobs cancelled while they waited. `start`: a
    job's task, given its `preempt` (asked between two layers of its pass; None with
    `max_active` 1: a pass is then evaluated whole) and its `regroup` (asked in its first
    pass's first layers: how many jobs arrived since, when that pass is to be taken back so
    that they share it, else 0; None without `prefill`); `end(job,
    result)`: a job's last event (it ran to its end, or was cancelled waiting). Inside a
    pass, `arrived()` peeks at the jobs submitted since (cheap when none was; nothing is
    taken). `batch(tasks, stops)`: the decode steps of several jobs in one pass (None: each
    decode step is a pass of its own). `prefill(tasks, stops)`: the first step of several
    jobs, their short prompts prefilled in one pass (None: a pass each). The pass is the
    schedule's plan (`policy/plan.py`). `report(schedule)`: what is under way now (the worker's
    status), after each admission (before the waiting are told their place) and after each
    pass (before the ends of the jobs it ended are sent)."""

    def admit(jobs: Sequence[Job]) -> None:
        for job in jobs:
            schedule.add(job)
        for job in schedule.cancelled():
            end(job, Finished("cancelled", 0, 0))
        for slot in schedule.admit():
            slot.job.queue_s = time.perf_counter() - slot.job.submitted
        report(schedule)
        for i, job in enumerate(schedule.waiting, 1):   # the rest: their place in line
            if job.position != i:
                job.position = i
                job.emit(Queued(i))

    def preempt(slot: Slot) -> bool:
        jobs = arrived()
        return bool(jobs) and schedule.preempts(slot, jobs)

    def regroup(slot: Slot) -> int:
        jobs = arrived()
        return len(jobs) if jobs and schedule.regroups(slot, jobs) else 0

    def begin(job: Job, slot: Slot) -> Task:
        many = schedule.max_active > 1
        return start(job, functools.partial(preempt, slot) if many else None,
                     functools.partial(regroup, slot) if many and prefill is not None else None)

    while True:
        jobs = take(schedule.idle())
        if jobs is None:
            return
        admit(jobs)
        if not schedule.active:
            continue
        slot = schedule.pick()
        if schedule.due:    # jobs wait for a prefix a started job is past: stored from it now
            for holder, at in schedule.due:
                assert holder.task is not None
                schedule.stored(holder, at, holder.task.publish(at))
            slot = schedule.pick()
        plan = schedule.plan(slot, batch is not None, prefill is not None)
        group = plan.slots
        for s in group:
            if s.task is None:     # with max_active 1 nobody can be admitted mid-pass
                s.task = begin(s.job, s)
        others = [s for s in schedule.active if s not in group]   # admitted before the pass
        tasks = [s.task for s in group if s.task is not None]
        stops = [s.job.cancelled for s in group]
        t0 = time.perf_counter()
        if plan.kind == "decode":
            assert batch is not None
            steps = batch(tasks, stops)
        elif plan.kind == "prefill":
            assert prefill is not None
            steps = prefill(tasks, stops)
        else:
            assert slot.task is not None
            steps = [slot.task.step(Decision(schedule.pass_tokens(slot), slot.job.cancelled,
                                             schedule.share(slot), schedule.pausable(slot)))]
        spent = time.perf_counter() - t0
        for other in others:
            other.job.paused_s += spent
        schedule.ran(slot, spent, isinstance(steps[0], Paused), others, group)
        for s, step in zip(group, steps, strict=True):   # a first pass taken back: its
            s.regrouped = isinstance(step, Regrouped)      # prompt can share a pass again
        if len(group) == 1:
            schedule.published(slot)
        ended = [(m, step) for m, step in zip(group, steps, strict=True)
                 if isinstance(step, Finished | Failed)]
        for member, _ in ended:
            schedule.remove(member)
        report(schedule)      # before the ends are sent: whoever saw one sees the job gone
        for member, step in ended:
            end(member.job, step)
