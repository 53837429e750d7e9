"""The worker's scheduler: up to `max_active` jobs are under way on the one generation thread,
and it runs exactly one forward pass at a time (issue 26); with `max_active` 1, one job at a
time to its end, by the same loop.

Owns: which waiting job is admitted (at most `max_active`, and by memory: the live caches of
the admitted jobs within `active_kv_bytes`, a short job beside a long answer borrowing the room
it leaves now, the long one held while it would take that room back: the rules are `room.py`'s;
a job that does not fit waits; one job alone is always admitted), which admitted job's pass
runs next (a decoding job's pass is one decode step of the decoding jobs whose rows fit the
budget as a batch pads them: `decoding`), whether a pass under way pauses
between two layers for a job that just arrived, and how many tokens a prefill pass takes (the
one place a pass is sized: `pass_tokens`). Admission, cancellation and the end of a job happen
between two passes, never inside one. Nothing here runs mlx: a job's passes are its `Task`
(`active.Active`, one typed step each), and `generator.py` owns starting and ending jobs.

Policy, between passes:
- a job whose client left first, before aging (it ends at its next pass, committing what it
  computed: at once, or after the rest of a paused pass). Then the soonest first token: a short
  prompt (at most `prefill_chunk` tokens) one pass from its first token (at most
  `prefill_slice` tokens left: a title call, a chat turn). Then decoding jobs (0 left). Then
  the other prefills, the least remaining first: a long prompt's last slices included (at its
  depth they are not short); a job not started yet counts what the worker's cache does not
  hold of it (a follow-up turn is its new tokens). Ties go to the job that ran least recently
  (decode steps of running jobs are interleaved round-robin);
- a job that arrives during a pass and ranks in a better class than the job whose pass it is
  (a short prompt arriving during a long prefill) does not wait for the pass to end: the pass
  pauses after the layer under way (`run.Run`: its graph is evaluated a layer at a time), the
  newcomer runs, and the paused pass resumes later where it stopped, with the result it would
  have given unpaused. So a short request waits for about one layer of the pass under way (a
  slice / the model's depth: tens of ms), not the slice. A group worker's passes never pause
  (its ranks run whole passes in lockstep);
- a short prompt's first pass (picked the moment it arrived) is taken back one layer in when
  jobs that arrived meanwhile would share its prefill pass (`regroups`, `plan.regroups`), so
  a burst's prompts prefill together;
- a job held for room (`room.Room.held`: a borrower's reservation would not fit beside its
  next pass) is not picked until the borrowers end;
- aging: a job that other jobs' passes kept waiting `AGE_LIMIT` slices' time in a row
  (`AGE_LIMIT` x `prefill_slice_ms`: 2 s by default; with `prefill_slice_ms` 0, `AGE_LIMIT`
  passes) runs next, the longest kept first, and its pass then runs to its end (it never pauses
  for a newcomer). So between two passes of an admitted job that may run (not held for room,
  nor waiting for another job's prefix: those are not picked, but the time counts, so they
  run first once they may) there are at most that much of other jobs' passes plus one pass of
  each other job (`max_active` - 1 passes): nobody starves. A paused pass's own time does not
  count as its run: it ages on. Counted in time, a run of cheap decode steps does not age a
  long prefill as fast as its own expensive slices would;
- a prefill pass is a slice of about `prefill_slice_ms`: as many tokens as the job's own last
  pass ran in that time (its rate at its depth in the prompt, which falls as the prompt grows;
  the worker's measured prefill rate for its first pass; `prefill_slice` tokens before any is
  measured), at least `MIN_SLICE` tokens and at most `prefill_chunk`; a short prompt with at most
  `prefill_slice` tokens left prefills them in one pass. Alone too: an aged pass, which does not
  pause, and a decode step waiting for a pass are kept at most about one slice. With
  `prefill_slice_ms` 0, slices are `prefill_slice` tokens while others wait, whole chunks alone.
  A paused prefill keeps its live cache as it is (nothing is recomputed or copied), and its
  checkpoints land where they would unpaused (placement is by position,
  `run.Run.prefill_passes`);
- a cancelled job stops within one pass (its Engine generator commits what it computed);
- a job's time admitted but paused while other jobs' passes ran is its `paused_s`, reported
  beside its `queue_s` (time waiting to be admitted): together, its time behind others. While
  it waits to be admitted it is told its place in line (`Queued`, a `: queued position=N`
  comment in its stream, as the proxy's queue says it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence

from prefixd.backends.mlx.scheduler.jobs import Job
from prefixd.backends.mlx.scheduler.policy.plan import Plan, prefill_rows, regroups
from prefixd.backends.mlx.scheduler.policy.room import PASS_LIMIT, Admission, Room
from prefixd.backends.mlx.scheduler.policy.sharing import Sharing
from prefixd.backends.mlx.scheduler.policy.slots import Slot

REFRESH = 64  # picks after which the waiting jobs' cache estimates are asked again anyway
# a job kept waiting this many slices' time in a row (with prefill_slice_ms 0: this many
# passes of other jobs) runs next
AGE_LIMIT = 8
MIN_SLICE = 32  # the smallest prefill slice, in tokens (smaller passes waste the device)


class Schedule(Sharing):
    """Pure policy over waiting and admitted jobs (no threads, no mlx)."""

    def __init__(self, max_active: int, prefill_slice: int, prefill_chunk: int,
                 active_kv_bytes: int, kv_bytes_per_token: int, slice_ms: float = 0.0,
                 prefill_rate: Callable[[], float | None] = lambda: None,
                 cached: Callable[[Job], int] = lambda job: 0, draft_tokens: int = 0,
                 per_request: int = 0) -> None:
        self.room = Room(active_kv_bytes, kv_bytes_per_token, per_request, draft_tokens)
        self.max_active, self.slice_tokens = max_active, min(prefill_slice, prefill_chunk)
        self.chunk = prefill_chunk
        self.slice_ms, self.rate, self.cached = slice_ms, prefill_rate, cached
        self.waiting: deque[Job] = deque()
        self.active: list[Slot] = []
        self.tick = 0
        # `cached` of the jobs not started, until the store may have changed (a job ended or
        # published a prefix, or `REFRESH` picks went by: a state import)
        self._estimates: dict[Job, int] = {}
        self._picks = 0
        self._shared: dict[tuple[int, int], int] = {}   # common prefix of two jobs' prompts
        self.held: dict[Slot, tuple[Slot, int]] = {}    # as of the last pick
        # (a started job, a prefix of its prompt it is past that jobs not started wait for):
        # to store from its live state before the next pass (`publish`), as of the last pick
        self.due: list[tuple[Slot, int]] = []
        self._tried: set[tuple[int, int]] = set()    # (job id, position) stored or tried
        self.waits: set[Slot] = set()   # held for room (`room.Room.held`), as of the last pick
        self._passed: dict[Job, int] = {}   # waiting jobs: later jobs admitted before them

    def _estimate(self, job: Job) -> int:
        if job not in self._estimates:
            self._estimates[job] = self.cached(job)
        return self._estimates[job]

    def idle(self) -> bool:
        return not self.waiting and not self.active

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def cancelled(self) -> list[Job]:
        """Waiting jobs whose client left (taken out; they end without running)."""
        gone = [j for j in self.waiting if j.cancelled]
        self.waiting = deque(j for j in self.waiting if not j.cancelled)
        for job in gone:
            self._passed.pop(job, None)
        return gone

    def _aged(self, s: Slot) -> bool:
        """Whether other jobs' passes kept `s` waiting its aging limit in a row."""
        if self.slice_ms > 0:
            return s.kept >= AGE_LIMIT * self.slice_ms / 1000
        return s.skipped >= AGE_LIMIT

    def _fits(self, job: Job, active: Sequence[Slot]) -> Admission | None:
        """Room for `job` beside `active` (`room.Room.fits`: how it is admitted; None: it
        does not fit)."""
        return self.room.fits(job, active, self.max_active,
                              any(self._aged(s) for s in self.waits))

    def admit(self) -> list[Slot]:
        """Admit the waiting jobs that fit (count and live-cache bytes, `room.py`), in order; a
        job that does not fit is passed by later ones that do, `PASS_LIMIT` times at most."""
        out: list[Slot] = []
        skipped: list[Job] = []
        for job in list(self.waiting):
            if len(self.active) >= self.max_active or \
                    any(self._passed.get(j, 0) >= PASS_LIMIT for j in skipped):
                break
            how = self._fits(job, self.active)
            if how is None:
                skipped.append(job)
                continue
            self.waiting.remove(job)
            self._passed.pop(job, None)
            for j in skipped:
                self._passed[j] = self._passed.get(j, 0) + 1
            slot = Slot(job, self.room.cost(job), how == "borrow", how == "alone",
                        cached=self._estimate(job))
            self.active.append(slot)
            out.append(slot)
        return out

    def pick(self) -> Slot:
        """The admitted job whose pass runs next (see the module docstring)."""
        self._picks += 1
        if self._picks % REFRESH == 0:
            self.changed()
        for s in self.active:     # what the cache holds of each job not started, as of now
            if s.task is None:
                s.cached = self._estimate(s.job)
        self.due = []
        self.held = {s: h for s in self.active if (h := self._holder(s)) is not None}
        self.waits = self.room.held(self.active, self._growth)
        slot, aged = self._choose([s for s in self.active
                                   if s not in self.held and s not in self.waits])
        slot.aged = aged
        return slot

    def changed(self) -> None:
        """The store may hold more of the waiting jobs' prompts: their estimates are asked
        again."""
        self._estimates.clear()

    def pausable(self, slot: Slot) -> bool:
        """Whether a newcomer could pause `slot`'s pass (`preempts`): not one aging chose, nor
        a short prefill's (nothing ranks before it). Else the pass is evaluated whole, without
        a sync per layer."""
        return not slot.aged and self._rank(slot)[0] > 0

    def _choose(self, free: list[Slot]) -> tuple[Slot, bool]:
        """The job that runs next (of `free`: those not waiting for another's prefix), and
        whether aging chose it."""
        free = free or self.active
        gone = [s for s in free if s.job.cancelled]
        if gone:      # its next pass ends it (after the rest of a paused pass)
            return gone[0], False
        aged = [s for s in free if self._aged(s)]
        if aged:
            return max(aged, key=lambda s: (s.kept, s.skipped, -s.last)), True
        return min(free, key=self._rank), False

    def preempts(self, slot: Slot, arrived: Sequence[Job]) -> bool:
        """Whether `slot`'s pass under way should pause between two layers: a job that arrived
        meanwhile would be admitted (after those waiting before it) and rank in a better class.
        Asked inside the pass, so it changes nothing: the newcomer is admitted after the pause,
        between two passes. Never a pass aging chose, nor a cancelled job's (it ends after its
        pass)."""
        if slot.aged or slot.job.cancelled:
            return False
        mine = self._rank(slot)[0]
        return any(self._rank(newcomer)[0] < mine for newcomer in self._newcomers(arrived))

    def regroups(self, slot: Slot, arrived: Sequence[Job]) -> bool:
        """Whether `slot`'s first prefill pass, in its first layers, is taken back to run
        again with jobs that arrived meanwhile (`plan.regroups`: they would be admitted and
        share its prompt's pass). Asked inside the pass, so it changes nothing: they are
        admitted after it, between two passes. Not a pass aging chose, nor a cancelled
        job's."""
        if slot.aged or slot.job.cancelled:
            return False
        return regroups(slot, list(self._newcomers(arrived)), self.slice_tokens)

    def _newcomers(self, arrived: Sequence[Job]) -> Iterator[Slot]:
        """The jobs waiting and those that `arrived`, as they would be admitted in turn (up
        to the first that would not fit): their slots, not admitted (nothing changes)."""
        active = list(self.active)
        for job in [*self.waiting, *arrived]:
            if job.cancelled:
                continue
            how = self._fits(job, active)
            if how is None:
                return
            active.append(Slot(job, self.room.cost(job), how == "borrow", how == "alone",
                               cached=self._estimate(job)))
            yield active[-1]

    def _rank(self, s: Slot) -> tuple[int, int, int]:
        left = s.remaining()
        if self._one_pass(s, left):
            return 0, left, s.last      # its next pass gives its first token
        return (1 if left == 0 else 2), left, s.last

    def _one_pass(self, s: Slot, left: int) -> bool:
        """A short prefill whose next pass is its last: a short prompt, or a turn whose
        conversation the cache holds (its work: what the cache did not hold when it started,
        at most `prefill_chunk`). Not a long prompt's last slice: deep in a long prompt each
        slice is as slow as the others."""
        return 0 < left <= self.slice_tokens and len(s.job.prompt.tokens) - s.cached <= self.chunk

    def ran(self, slot: Slot, seconds: float = 0.0, paused: bool = False,
            others: Sequence[Slot] | None = None, group: Sequence[Slot] = ()) -> None:
        """`slot`'s pass ran, for `seconds` (`paused`: part of it, up to a pause), with the
        decode steps of `group` in it: `others` (the other admitted jobs) were kept waiting
        that long."""
        self.tick += 1
        for s in group or (slot,):
            if not paused:
                s.last, s.skipped, s.kept = self.tick, 0, 0.0
        for s in self.active if others is None else others:
            if s is not slot and s not in group:
                s.skipped += 1
                s.kept += seconds

    def pass_tokens(self, slot: Slot | None = None) -> int:
        """Tokens of `slot`'s next prefill pass (see the module docstring): the one place a
        pass is sized. With `max_active` 1 nobody can run between two passes: a whole chunk."""
        if self.max_active == 1:
            return self.chunk
        if self.slice_ms <= 0:
            return self.slice_tokens if len(self.active) + len(self.waiting) > 1 else self.chunk
        if slot is not None and self._one_pass(slot, slot.remaining()):
            return self.slice_tokens    # a short prompt's prefill: one pass to its first token
        rate = slot.task.pass_rate() if slot is not None and slot.task is not None else None
        rate = rate or self.rate()
        if not rate:
            return self.slice_tokens
        return max(MIN_SLICE, min(self.chunk, int(rate * self.slice_ms / 1000)))

    def plan(self, slot: Slot, batches: bool = True, together: bool = False) -> Plan:
        """The pass `slot` was picked for (`plan.Plan`): with `batches`, a decode pass of the
        decoding and ready jobs (`decoding`) where there are several; with `together`, a
        prefill pass of several short prompts not started (`plan.prefill_rows`); else its step."""
        rows = self.decoding(slot) if batches else [slot]
        if len(rows) > 1:
            return Plan("decode", rows)
        rows = prefill_rows(slot, self.active, {*self.waits, *self.held}, self.slice_tokens) \
            if together else [slot]
        return Plan("prefill", rows) if len(rows) > 1 else Plan("step", [slot])

    def decoding(self, slot: Slot) -> list[Slot]:
        """The jobs whose decode steps run in `slot`'s pass: with `slot` decoding (or ready:
        its prompt's last token waits, `Task.ready`), the started jobs decoding or ready and
        not held for room whose rows fit the budget as a batch pads them
        (`room.Room.batch_rows`; their steps share one forward pass), if `slot` is one of
        them; else `slot` (a pass of its own). So a newcomer's first token comes from the
        decoding jobs' next pass, which they do not wait through a pass of its own for."""
        if not _rides(slot):
            return [slot]
        rows = [s for s in self.active if _rides(s) and s not in self.waits]
        batch = self.room.batch_rows(rows, self.active) if slot in rows else []
        return batch if slot in batch else [slot]

    def _growth(self, slot: Slot) -> int:
        """Bytes `slot`'s next pass adds to its live cache at most."""
        tokens = self.pass_tokens(slot) if slot.remaining() else 1 + self.room.draft
        return tokens * self.room.per_token

    def remove(self, slot: Slot) -> None:
        self.active.remove(slot)
        self.waits.discard(slot)
        self.changed()      # its state is stored now
        self._shared = {k: v for k, v in self._shared.items() if id(slot.job) not in k}
        self._tried = {k for k in self._tried if k[0] != id(slot.job)}


def _rides(s: Slot) -> bool:
    """Whether `s`'s next step can be a row of a decode pass: it decodes, or its prompt's
    last token waits for one."""
    return s.task is not None and (s.remaining() == 0 or s.task.ready())
