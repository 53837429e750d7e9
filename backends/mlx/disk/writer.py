"""The disk tier's writer thread: turns `Job`s into block and record files, one job at a time.

Owns: `Job` and `State` (what the generation thread hands over: host arrays only, built by
`disk/persist.py`, so no mlx call happens here), the job queue, the thread, and the file writes. It
writes each byte once: a block is content-addressed by its prefix (`disk/chain.py`) and written only
if absent; a record (the state at one position) likewise. Before a write it asks the tier
(`disk/index.py`) for room under the budget; after it, it indexes what it wrote. A write that fails
(a full or failing disk) leaves nothing behind: no temp file, and no block written for it that
no record needs. The tier's one lock guards the queue as well as the index; no file is written
while it is held.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from prefixd.backends.mlx.disk import chain
from prefixd.backends.mlx.disk import fmt as diskfmt
from prefixd.backends.mlx.disk.records import Block, Record

log = logging.getLogger("prefixd.worker.disk")


@dataclass
class State:
    """One record to write: the state at `pos` of the job's tokens, apart from the KV."""

    pos: int
    tensors: diskfmt.Host            # the non-KV leaves' arrays
    leaves: dict[int, Any]           # leaf index -> {"class", "state": skeleton}
    dtypes: dict[str, str]
    trimmable: bool


@dataclass(eq=False)
class Job:
    """What the writer persists for one entry: host arrays only (no mlx on the writer)."""

    tokens: np.ndarray                   # int32, at least as long as every state's pos
    kv: dict[int, list[np.ndarray]]      # leaf -> its position-indexed buffers [b, h, cap, d]
    kv_desc: dict[int, dict[str, Any]]
    kv_dtypes: dict[str, str]            # "leaf.buffer" -> original dtype (bfloat16)
    states: list[State]
    reason: str                          # idle | evicted | shutdown
    done: threading.Event = field(default_factory=threading.Event)
    written: set[int] = field(default_factory=set)   # positions now on disk (new or present)

    def nbytes(self) -> int:
        """What its arrays hold (views of the entry's: what it keeps alive until written)."""
        return sum(a.nbytes for bufs in self.kv.values() for a in bufs) + \
            sum(a.nbytes for s in self.states for a in s.tensors.values())

    def finish(self) -> None:
        """Written (or failed, or refused): its arrays let go (host views that keep the entry's
        MLX arrays alive: whoever still holds the job, the ledger of lost prefixes included,
        holds only its outcome), then `done` set."""
        self.kv, self.states = {}, []
        self.done.set()


class Shelf(Protocol):
    """The index the writer writes for, as it uses it (`index.DiskTier`): its folder and key,
    its lock and counters, room under the budget, and what it indexes."""

    root: Path
    salt: str
    layout: Any
    block: int
    blocks: dict[str, Block]
    counters: collections.Counter[str]
    lock: threading.Lock

    def touch(self, rid: str) -> bool: ...

    def make_room(self, need: int, keep: set[str]) -> bool: ...

    def drop_unused(self, bids: set[str]) -> None: ...

    def add_block(self, bid: str, blk: Block) -> None: ...

    def add_record(self, rec: Record) -> None: ...


class DiskWriter:
    """The one thread that writes a tier's files (started by `DiskTier.start`)."""

    def __init__(self, tier: Shelf) -> None:
        self.tier = tier
        self._jobs: collections.deque[Job] = collections.deque()
        self._wake = threading.Condition(tier.lock)
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="prefixd-disk", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._wake:
            if self._closed:
                job.finish()
                return
            self._jobs.append(job)
            self._wake.notify()

    def drain(self, timeout: float) -> bool:
        """Wait until every submitted job is written (or `timeout`); False if not all were."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(min(left, 0.1))
        return True

    def stop(self, timeout: float) -> bool:
        """Take no more jobs and let the thread end once the queue is empty, after waiting at
        most `timeout` for it to empty; whether it did."""
        done = self.drain(timeout) if timeout > 0 else not self._jobs
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        return done

    def pending(self) -> int:
        """Jobs queued or being written (the caller holds the tier's lock)."""
        return len(self._jobs) + self._busy

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._jobs and not self._closed:
                    self._wake.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self._persist(job)
            except OSError as e:        # a full or failing disk: not a bug
                log.warning("disk cache: a write failed (%s); its state stays RAM-only", e)
                self.tier.counters["write_errors"] += 1
            except Exception:
                log.exception("disk cache: writing a job failed; its state stays RAM-only")
                self.tier.counters["write_errors"] += 1
            finally:
                job.finish()
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _persist(self, job: Job) -> None:
        """Write the job's states not on disk yet. A state inside a block the job's tokens
        complete references that block (its load trims it); only a state in the entry's last,
        unfinished block carries its own tail of KV."""
        t = self.tier
        ids = chain.block_ids(t.salt, job.tokens, t.block)
        per_token = _kv_bytes_per_token(job)
        for s in sorted(job.states, key=lambda s: s.pos):
            rid = chain.record_id(t.salt, job.tokens, s.pos, t.block, ids)
            used = min(len(ids), -(-s.pos // t.block))     # blocks holding [0, pos)
            tail = max(0, s.pos - used * t.block)
            with t.lock:
                if t.touch(rid):
                    job.written.add(s.pos)
                    continue
                missing = [j for j in range(used) if ids[j] not in t.blocks]
                need = len(missing) * (per_token + 4) * t.block + 4096 + \
                    (per_token + 4) * tail + sum(a.nbytes for a in s.tensors.values())
                if not t.make_room(need, set(ids[:used])):
                    t.counters["rejected"] += 1
                    continue
            written: set[str] = set()
            try:
                for j in missing:
                    self._write_block(job, j, ids)
                    written.add(ids[j])
                self._write_record(job, s, rid, ids[:used])
            finally:               # a failed record: the blocks only it needed go too
                with t.lock:
                    t.drop_unused(written)

    def _write_record(self, job: Job, s: State, rid: str, ids: list[str]) -> None:
        """The record of `s` over its blocks `ids` (written already), then indexed."""
        t = self.tier
        start = len(ids) * t.block
        tensors, desc = _record_tensors(job, s, start)
        desc.update(format=diskfmt.FORMAT, key=t.salt, block_tokens=t.block,
                    kind="record", layout=t.layout, blocks=ids, id=rid)
        path = t.root / "records" / (rid + diskfmt.SUFFIX)
        size = diskfmt.write(path, tensors, desc)
        diskfmt.sync_dir(t.root / "records")
        rec = Record(rid, s.pos, tuple(ids), job.tokens[start:s.pos].copy(), size,
                     s.trimmable, time.time())
        with t.lock:
            if any(b not in t.blocks for b in ids):    # a block found corrupt meanwhile
                path.unlink(missing_ok=True)
                return
            t.add_record(rec)
            t.counters["written_bytes"] += size
            t.counters["written_records"] += 1
            job.written.add(s.pos)

    def _write_block(self, job: Job, j: int, ids: list[str]) -> None:
        t = self.tier
        lo, hi = j * t.block, (j + 1) * t.block
        tensors = {f"{i}.{b}": buf[..., lo:hi, :] for i, bufs in job.kv.items()
                   for b, buf in enumerate(bufs)}
        tensors["tokens"] = job.tokens[lo:hi]
        desc = {"format": diskfmt.FORMAT, "key": t.salt, "block_tokens": t.block,
                "kind": "block", "id": ids[j], "parent": ids[j - 1] if j else None,
                "dtypes": job.kv_dtypes}
        size = diskfmt.write(t.root / "blocks" / (ids[j] + diskfmt.SUFFIX), tensors, desc)
        diskfmt.sync_dir(t.root / "blocks")
        with t.lock:
            t.add_block(ids[j], Block(size, job.tokens[lo:hi].copy()))
            t.counters["written_bytes"] += size
            t.counters["written_blocks"] += 1


def _kv_bytes_per_token(job: Job) -> int:
    return sum(b.nbytes // max(1, b.shape[-2]) for bufs in job.kv.values() for b in bufs)


def _record_tensors(job: Job, s: State, whole: int) -> tuple[diskfmt.Host, dict[str, Any]]:
    """A record's arrays (tail KV `[whole, pos)`, empty when its blocks cover `pos`; tail
    tokens; the other leaves) and the part of its description that is about them."""
    tensors = {f"{i}.{b}": buf[..., whole:s.pos, :] for i, bufs in job.kv.items()
               for b, buf in enumerate(bufs)}
    tensors["tokens"] = job.tokens[whole:s.pos]
    tensors.update(s.tensors)
    leaves = {str(i): d for i, d in job.kv_desc.items()}
    leaves.update({str(i): d for i, d in s.leaves.items()})
    return tensors, {"pos": s.pos, "trimmable": s.trimmable, "leaves": leaves,
                     "dtypes": {**job.kv_dtypes, **s.dtypes}}
