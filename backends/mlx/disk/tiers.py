"""RAM first, disk second: when entries go to disk, when a disk record is worth loading, and why
a lookup restored less than the worker knew (generation thread; the Engine owns one).

Owns:
- the write schedule: a finished entry is written once it has been idle `write_delay` seconds
  (an entry that a newer turn absorbs before then, i.e. a superseded state of an active
  conversation, is never written); an entry the RAM budget evicts is written at once, unless
  the evicted states waiting for the writer already hold `WAITING_SHARE` of the RAM budget
  (their arrays live outside it until written); at shutdown everything not yet written is;
- the measured rates (prefill tokens/s, disk bytes/s) that decide whether loading a record beats
  prefilling the tokens it would save;
- the ledger of restorable states this process had and lost (evicted from RAM with no disk
  copy, evicted from disk, found corrupt, write still pending), so every lookup that restores
  less than the longest prefix the worker knows names a reason (`MISS_REASONS`).
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prefixd.backends.mlx.cache.store import Entry
from prefixd.backends.mlx.disk import chain
from prefixd.backends.mlx.disk.index import DiskTier
from prefixd.backends.mlx.disk.persist import make_job
from prefixd.backends.mlx.disk.records import Record
from prefixd.backends.mlx.disk.writer import Job

MISS_REASONS = ("evicted", "disk_evicted", "not_on_disk", "write_pending", "not_stored",
                "load_slower_than_prefill", "format_mismatch", "corrupt", "restore_error",
                "not_restorable")
LEDGER_TOKENS = 4_000_000        # token ids the ledger keeps (16 MB), oldest forgotten first
HELD = float("inf")              # an entry a running request restored from: not due


@dataclass(eq=False)
class Lost:
    tokens: np.ndarray
    positions: list[int]
    reason: str
    job: Job | None = None


@dataclass(frozen=True)
class Decision:
    """What the disk tier offers beyond the RAM match at `ram_pos`."""

    disk: tuple[Record, int] | None      # load this record, restoring this many tokens
    known: int                           # the longest restorable prefix the worker knows
    reason: str | None                   # why `known` will not be restored, if it will not


class Rates:
    """Exponential moving averages of the prefill rate and the disk read rate."""

    def __init__(self) -> None:
        self.prefill_tps: float | None = None
        self.read_bps: float | None = None

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        return new if old is None else 0.7 * old + 0.3 * new

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens >= 16 and seconds > 0:
            self.prefill_tps = self._ema(self.prefill_tps, tokens / seconds)

    def read(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.read_bps = self._ema(self.read_bps, nbytes / seconds)

    def worth_loading(self, nbytes: int, tokens_saved: int) -> bool:
        """Unknown rates: try (the load measures the disk)."""
        if self.prefill_tps is None or self.read_bps is None:
            return True
        return nbytes / self.read_bps < tokens_saved / self.prefill_tps

    def seconds_for(self, tokens: int) -> float:
        return tokens / self.prefill_tps if self.prefill_tps else 0.0


# Of the RAM budget, how much the evicted states waiting for the writer may hold (outside the
# budget: their arrays live until written). A disk slower than the evictions would otherwise
# let them grow without bound; past it an evicted state is not written (`not_on_disk`).
WAITING_SHARE = 0.25


class Tiers:
    def __init__(self, disk: DiskTier | None, kv_idx: Sequence[int], snap_idx: Sequence[int],
                 write_delay: float, ram_budget: int | None = None) -> None:
        self.disk = disk
        # evicted states' jobs not written yet, and their bytes (None: no bound)
        self.waiting_limit = None if ram_budget is None else int(ram_budget * WAITING_SHARE)
        self._waiting: dict[Job, int] = {}
        self.kv_idx, self.snap_idx = tuple(kv_idx), tuple(snap_idx)
        self.write_delay = write_delay
        self.rates = Rates()
        self.due: dict[Entry, float] = {}
        self.written: weakref.WeakSet[Entry] = weakref.WeakSet()
        self._ledger: collections.deque[Lost] = collections.deque()
        self._ledger_tokens = 0
        self._lock = threading.Lock()        # the disk writer adds `disk_evicted` items
        self.misses = collections.Counter[str]()

    # --- the write schedule -----------------------------------------------------------------
    def committed(self, entry: Entry, now: float) -> None:
        for e, t in self.due.items():        # the request that held them is over
            if t == HELD:
                self.due[e] = now + self.write_delay
        if self.disk is not None and not entry.namespace:    # partitions stay in RAM
            self.due[entry] = now + self.write_delay

    def hold(self, entry: Entry) -> None:
        """A request restored from `entry`: its conversation is active, do not write it now."""
        if entry in self.due:
            self.due[entry] = HELD

    def next_due(self) -> float | None:
        return min(self.due.values(), default=None)

    def ready(self, now: float) -> list[Entry]:
        """The entries idle for `write_delay` (due to be written now)."""
        return [e for e, t in self.due.items() if t <= now]

    def flush(self, entries: Sequence[Entry]) -> int:
        """Submit the jobs of these due entries; how many were submitted."""
        for e in entries:
            if self.due.pop(e, None) is not None and self.disk is not None:
                self._write(e, "idle")
        return len(entries)

    def flush_all(self, entries: Sequence[Entry]) -> None:
        self.due.clear()
        for e in entries:
            if not e.in_progress and not e.namespace and e not in self.written:
                self._write(e, "shutdown")

    def removed(self, entry: Entry, why: str) -> None:
        """The RAM store dropped `entry` (merged into a newer one, discarded, evicted). A
        partition's entry (per-key isolation) leaves no trace: not written, not in the ledger
        (whose miss reasons another key's request would see)."""
        self.due.pop(entry, None)
        if entry.namespace:
            return
        if why == "rejected":                # computed, but more than the RAM budget holds
            self._lose(entry, [*sorted(entry.checkpoints), len(entry.tokens)], "not_stored")
            return
        if why != "evicted" or entry.payload is None:
            return
        positions = [*sorted(entry.checkpoints), len(entry.tokens)]
        if self.disk is None:
            self._lose(entry, positions, "evicted")
        elif entry not in self.written:
            job = self._write(entry, "evicted", evicted=True)
            self._lose(entry, positions, "write_pending" if job else "not_on_disk", job)

    def dropped(self, entry: Entry, pos: int, payload: object) -> None:
        """The RAM store dropped one checkpoint of `entry` under budget pressure."""
        if entry.namespace:
            return
        if self.disk is None or entry.payload is None:
            self._lose(entry, [pos], "evicted")
        elif entry not in self.written:
            job = make_job(self.disk, entry, self.kv_idx, self.snap_idx, "evicted",
                           {pos: payload})
            job = self._submit(job, evicted=True)
            self._lose(entry, [pos], "write_pending" if job else "not_on_disk", job)

    def _write(self, entry: Entry, reason: str, evicted: bool = False) -> Job | None:
        assert self.disk is not None
        job = make_job(self.disk, entry, self.kv_idx, self.snap_idx, reason)
        self.written.add(entry)
        return self._submit(job, evicted)

    def _submit(self, job: Job | None, evicted: bool) -> Job | None:
        """Queue `job` for the writer; None if there is none, or if it is an evicted state's
        and the evicted states waiting to be written already hold `waiting_limit` bytes (it
        is dropped: counted as `skipped_writes`)."""
        if job is None or self.disk is None:
            return None
        if evicted and self.waiting_limit is not None:
            self._waiting = {j: n for j, n in self._waiting.items() if not j.done.is_set()}
            nbytes = job.nbytes()
            if self._waiting and sum(self._waiting.values()) + nbytes > self.waiting_limit:
                job.finish()
                self.disk.counters["skipped_writes"] += 1
                return None
            self._waiting[job] = nbytes
        self.disk.submit(job)
        return job

    # --- the ledger -------------------------------------------------------------------------
    def disk_evicted(self, tokens: np.ndarray, pos: int, reason: str) -> None:
        """Called by the disk tier (any thread) for a record it dropped: `disk_evicted` by its
        budget, or `corrupt`."""
        with self._lock:
            self._add(Lost(tokens, [pos], reason))

    def _lose(self, entry: Entry, positions: list[int], reason: str,
              job: Job | None = None) -> None:
        with self._lock:
            self._add(Lost(chain.as_tokens(entry.tokens), positions, reason, job))

    def _add(self, lost: Lost) -> None:
        self._ledger.append(lost)
        self._ledger_tokens += len(lost.tokens)
        while self._ledger_tokens > LEDGER_TOKENS and len(self._ledger) > 1:
            self._ledger_tokens -= len(self._ledger.popleft().tokens)

    def _lost_best(self, prompt: np.ndarray, above: int) -> tuple[int, str | None]:
        best, reason = above, None
        with self._lock:
            items = list(self._ledger)
        for lost in items:
            limit = min(chain.common_prefix(lost.tokens, prompt), len(prompt) - 1)
            for p in lost.positions:
                if best < p <= limit:
                    why = lost.reason
                    if lost.job is not None and lost.job.done.is_set():
                        if p in lost.job.written:
                            continue          # on disk now: the disk lookup saw it
                        why = "not_on_disk"
                    best, reason = p, why
        return best, reason

    # --- lookups ----------------------------------------------------------------------------
    def decide(self, prompt: Sequence[int], ram_pos: int, namespace: str = "") -> Decision:
        """Where a prompt restores from: RAM, or a longer prefix on disk. A partition's
        request (per-key isolation) sees RAM only: the disk tier and the ledger of lost
        prefixes hold the shared partition's."""
        if namespace or (self.disk is None and not self._ledger):
            return Decision(None, ram_pos, None)
        arr = chain.as_tokens(prompt)
        found = self.disk.lookup(arr) if self.disk is not None else None
        known, reason = self._lost_best(arr, ram_pos)
        if found is None or found[1] <= ram_pos:
            return Decision(None, max(known, ram_pos), reason)
        rec, pos = found
        if not self.rates.worth_loading(self._record_bytes(rec), pos - ram_pos):
            return Decision(None, max(known, pos), "load_slower_than_prefill")
        return Decision(found, max(known, pos), reason if known > pos else None)

    def _record_bytes(self, rec: Record) -> int:
        assert self.disk is not None
        blocks = self.disk.blocks
        return rec.nbytes + sum(blocks[b].nbytes for b in rec.blocks if b in blocks)

    def count_miss(self, reason: str) -> None:
        with self._lock:
            self.misses[reason] += 1

    def miss_counts(self) -> dict[str, int]:
        """A copy, safe from any thread."""
        with self._lock:
            return dict(self.misses)


def now() -> float:
    return time.monotonic()
