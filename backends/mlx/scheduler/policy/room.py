"""Admission by memory: the live caches of the admitted jobs kept within the budget
(`active_kv_share` of the cache budget) without holding a short job behind a long answer for
the whole of it (issue 47).

Owns nothing between calls: pure functions of the admitted `Slot`s (`schedule.py` owns them).

Bytes a job is charged:
- its reservation (`Slot.kv_bytes`, `Room.cost`): its prompt + max_tokens + a verify pass's
  draft positions, x the model's KV bytes per token, + what it holds besides KV (recurrent
  states, a pass's logits): the most its live cache can reach;
- what it holds now (`Room.now`): the tokens its live cache holds so far at the same rates (a
  job not started yet: its reservation).

A job is admitted (besides the count, `max_active`) when:
1. every admitted job's reservation and its own fit the budget: each can reach its end
   whatever the others do (`plain`). Rows are not charged as a decode batch pads them: the
   batch takes only the rows whose padded copy fits (`batch_rows`), the others decode in
   passes of their own;
2. or it borrows the room the others leave now: its reservation fits beside what the others
   hold now (other borrowers: their reservations), and it is smaller than what one of those
   others may still write (its reservation less what it holds now): a short job beside a long
   answer, never a long answer in place of another. While a borrower is under way, a job that
   is not one is held (`held`: its passes wait) whenever its next pass would leave the
   borrowers less than their reservations: the long answer pauses for the short one and goes
   on when it ends (its cache kept as it is). No job borrows while a held job has been kept
   waiting `AGE_LIMIT` slices (it runs again as soon as the borrowers end);
3. or it is alone (one job alone always runs, whatever its reservation). A job admitted alone
   whose reservation passes the budget raises the budget to its reservation while it is under
   way (`limit`): the memory it may reach alone anyway. So short jobs borrow beside it too (rule
   2), and it is held while they would take the room back: together they never hold more than
   it alone could.

So a newcomer waits for memory only while the jobs under way fill the budget by what they
already hold, or while it is as long as what they still have to write; and admission skips a
waiting job that does not fit for those behind it that do (`PASS_LIMIT` times at most).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from prefixd.backends.mlx.scheduler.jobs import Job

if TYPE_CHECKING:
    from prefixd.backends.mlx.scheduler.policy.slots import Slot

PASS_LIMIT = 8  # later jobs admitted before a waiting one that does not fit, at most
Admission = Literal["plain", "borrow", "alone"]   # by rule 1, 2 or 3 (the module docstring)


@dataclass(frozen=True)
class Room:
    """The live-cache budget and the rates a job is charged at."""

    budget: int
    per_token: int      # KV bytes per token (`sizing.kv_bytes_per_token`)
    per_request: int    # what a job holds besides KV (`sizing.request_bytes`)
    draft: int          # positions a verify pass adds for a moment

    def cost(self, job: Job) -> int:
        """`job`'s reservation: the most its live cache can reach."""
        return self.bytes(len(job.prompt.tokens) + job.max_tokens)

    def bytes(self, tokens: int) -> int:
        return (tokens + self.draft) * self.per_token + self.per_request

    def now(self, slot: Slot) -> int:
        """What `slot` holds now (not started: its reservation)."""
        if slot.task is None:
            return slot.kv_bytes
        return min(slot.kv_bytes, self.bytes(slot.task.length()))

    def charge(self, slot: Slot) -> int:
        """What `slot` counts for while borrowers are under way: a borrower its reservation,
        the others what they hold now."""
        return slot.kv_bytes if slot.borrows else self.now(slot)

    def limit(self, active: Sequence[Slot]) -> int:
        """The budget, or the reservation of a job admitted alone past it (rule 3)."""
        return max([self.budget, *(s.kv_bytes for s in active if s.alone)])

    def fits(self, job: Job, active: Sequence[Slot], max_active: int,
             starving: bool = False) -> Admission | None:
        """How `job` may be admitted beside `active` (rule 1, 2 or 3), None if it does not
        fit. `starving`: a held job has waited its aging limit (nobody borrows)."""
        if len(active) >= max_active:
            return None
        cost = self.cost(job)
        if not active:
            return "alone" if cost > self.budget else "plain"
        limit = self.limit(active)
        if sum(s.kv_bytes for s in active) + cost <= limit:
            return "plain"
        if starving or sum(self.charge(s) for s in active) + cost > limit:
            return None
        ahead = max((s.kv_bytes - self.now(s) for s in active if not s.borrows), default=0)
        return "borrow" if cost < ahead else None

    def held(self, active: Sequence[Slot], growth: Callable[[Slot], int]) -> set[Slot]:
        """The jobs whose next pass waits for room: with a borrower under way, every job that
        is not one (nor cancelled: its pass ends it) while one more pass of it (`growth`: the
        bytes a prefill slice or a decode step adds) would leave the borrowers less than their
        reservations."""
        if not any(s.borrows for s in active):
            return set()
        charged, limit = sum(self.charge(s) for s in active), self.limit(active)
        return {s for s in active if not s.borrows and not s.job.cancelled
                and charged + growth(s) > limit}

    def batch_rows(self, rows: Sequence[Slot], active: Sequence[Slot]) -> list[Slot]:
        """Of the decoding `rows`, those whose decode steps share a pass: the most of the
        shortest whose copy in the batch (every row padded to the longest of them) fits the
        budget beside what the others are charged. At least the shortest one (a pass of its
        own when no second fits)."""
        now = {s: self.now(s) for s in rows}
        ordered = sorted(rows, key=now.__getitem__)
        charged = [self.charge(s) for s in ordered]
        total = sum(self.charge(s) for s in active if s not in now) + sum(charged)
        limit = self.limit(active)
        for k in range(len(ordered), 1, -1):     # the most first: all of them, usually
            padded = now[ordered[k - 1]]
            if total + sum(max(c, padded) - c for c in charged[:k]) <= limit:
                return [s for s in rows if now[s] <= padded][:k]   # in their order
        return ordered[:1]
