"""The disk tier of the worker's prompt cache: an index of block and record files under a byte
budget, and the writer thread that persists jobs.

Owns: the directory of one cache key (`<cache_dir>/prompts/<key>/`: `manifest.json`,
`blocks/`, `records/`), its in-memory index (rebuilt from the files' own descriptions at start:
no separate index file can go stale), lookups of the longest restorable prefix, the disk budget
with its eviction, and the writer thread. The generation thread prepares `Job`s (host arrays
only, see `persist.py`) and calls `lookup`/`pin`; the writer thread does all hashing and file
I/O. One lock guards the index; file reads and writes happen outside it.

Writes each byte once: a block is content-addressed by its prefix (`chain.py`) and written only
if absent; a record (the state at one position) likewise. Eviction (when a write would exceed
the budget) drops the records worth least: the tokens they save beyond the nearest record below
them on the same prefix, divided by their recency rank (the RAM store's rule); a block goes
when no record needs it. A file being loaded is pinned and never evicted under the reader.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prefixd.backends.mlx import chain, diskfmt, diskrec
from prefixd.backends.mlx.diskrec import Block, Record

log = logging.getLogger("prefixd.worker.disk")
COUNTERS = ("written_bytes", "written_blocks", "written_records", "evicted_records", "rejected",
            "write_errors")


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


class DiskTier:
    def __init__(self, root: Path, salt: str, layout: list[str], budget: int, block: int,
                 on_evict: Callable[[np.ndarray, int], None] = lambda tokens, pos: None
                 ) -> None:
        self.root, self.salt, self.layout = root, salt, layout
        self.budget, self.block = budget, block
        self.on_evict = on_evict                 # (tokens, pos) of a record evicted by budget
        self.records: dict[str, Record] = {}
        self._by_key: dict[str | None, dict[str, Record]] = {}   # see `_keys`
        self.blocks: dict[str, Block] = {}
        self.bytes_used = 0
        self.counters = collections.Counter[str]()   # written_bytes, evicted, rejected, ...
        self.skipped = collections.Counter[str]()    # files never loaded, by reason
        self._pinned: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._jobs: collections.deque[Job] = collections.deque()
        self._wake = threading.Condition(self._lock)
        self._busy = False
        self._closed = False
        for sub in ("blocks", "records"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self._owner = _own(root)
        self._write_manifest()
        self._thread = threading.Thread(target=self._run, name="prefixd-disk", daemon=True)

    def start(self) -> None:
        """Start the writer (after `diskindex.index_directory` has filled the index)."""
        self._thread.start()

    def _write_manifest(self) -> None:
        path = self.root / "manifest.json"
        if not path.exists():
            path.write_text(json.dumps({"format": diskfmt.FORMAT, "key": self.salt,
                                        "layout": self.layout, "block_tokens": self.block},
                                       indent=1))

    def desc_ok(self, desc: dict[str, Any], kind: str) -> str | None:
        """Why a file's description does not belong to this tier, else None."""
        if desc.get("format") != diskfmt.FORMAT:
            return "newer_format" if isinstance(desc.get("format"), int) and \
                desc["format"] > diskfmt.FORMAT else "format_mismatch"
        if desc.get("key") != self.salt or desc.get("block_tokens") != self.block:
            return "foreign"
        if desc.get("kind") != kind or (kind == "record" and desc.get("layout") != self.layout):
            return "format_mismatch"
        return None

    # --- generation thread ------------------------------------------------------------------
    def lookup(self, prompt: np.ndarray) -> tuple[Record, int] | None:
        """The record restoring the most tokens of `prompt` (at most `len(prompt) - 1`), and
        the position it restores (a trimmable record also serves shorter prefixes)."""
        best: tuple[Record, int] | None = None
        ids = chain.block_ids(self.salt, prompt, self.block)
        with self._lock:     # only records whose whole blocks lie on the prompt's chain
            found: dict[str, Record] = {}
            for key in (None, *ids):
                found.update(self._by_key.get(key, {}))
        for r in found.values():
            try:   # (no lock: a block the writer drops meanwhile belonged to an evicted record)
                lcp = diskrec.common_prefix(r, prompt, ids, self.blocks, self.block)
            except KeyError:
                continue
            limit = min(lcp, len(prompt) - 1)
            pos = r.pos if r.pos <= limit else (limit if r.trimmable else 0)
            if pos > 0 and (best is None or (pos, r.last_used) > (best[1], best[0].last_used)):
                best = (r, pos)
        return best

    def absent(self, rids: dict[int, str]) -> set[int]:
        """The keys of `rids` (position -> record id) whose record is not on disk."""
        with self._lock:
            return {p for p, rid in rids.items() if rid not in self.records}

    def pin(self, r: Record) -> list[Path] | None:
        """Keep `r` and its blocks from eviction while they are read; their paths (record
        last), or None if it is gone. `unpin` afterwards."""
        with self._lock:
            if r.rid not in self.records:
                return None
            self._pinned[r.rid] += 1
            r.last_used = time.time()
        return [self.root / "blocks" / (b + diskfmt.SUFFIX) for b in r.blocks] + \
            [self.root / "records" / r.path_name]

    def unpin(self, r: Record) -> None:
        with self._lock:
            self._pinned[r.rid] -= 1

    def forget(self, r: Record, reason: str) -> None:
        """A record that failed to load: drop it from the index and delete its file (its own
        key, so no other version of prefixd wants it); counted under `reason`."""
        with self._lock:
            if self.records.pop(r.rid, None) is not None:
                self._unindex(r)
                (self.root / "records" / r.path_name).unlink(missing_ok=True)
                self._release(r, keep=set(r.blocks))   # the writer may be using them
                self.skipped[reason] += 1

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._closed:
                job.done.set()
                return
            self._jobs.append(job)
            self._wake.notify()

    def drain(self, timeout: float) -> bool:
        """Wait until every submitted job is written (or `timeout`); False if not all were."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(min(left, 0.1))
        return True

    def close(self, timeout: float = 0.0) -> bool:
        done = self.drain(timeout) if timeout > 0 else not self._jobs
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if done and self._owner is not None:
            self._owner.close()           # the next owner may come (a restart in-process)
            self._owner = None
        return done

    def info(self) -> dict[str, Any]:
        with self._lock:
            return {"dir": str(self.root), "bytes_used": self.bytes_used,
                    "bytes_budget": self.budget, "records": len(self.records),
                    "blocks": len(self.blocks), "block_tokens": self.block,
                    "pending_jobs": len(self._jobs) + self._busy,
                    "skipped_files": dict(self.skipped),
                    **{k: self.counters[k] for k in COUNTERS}}

    # --- writer thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._wake.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self._persist(job)
            except Exception:
                log.exception("disk cache: writing a job failed; its state stays RAM-only")
                self.counters["write_errors"] += 1
            finally:
                job.done.set()
                with self._lock:
                    self._busy = False
                    self._wake.notify_all()

    def _persist(self, job: Job) -> None:
        """Write the job's states not on disk yet. A state inside a block the job's tokens
        complete references that block (its load trims it); only a state in the entry's last,
        unfinished block carries its own tail of KV."""
        ids = chain.block_ids(self.salt, job.tokens, self.block)
        per_token = _kv_bytes_per_token(job)
        for s in sorted(job.states, key=lambda s: s.pos):
            rid = chain.record_id(self.salt, job.tokens, s.pos, self.block, ids)
            used = min(len(ids), -(-s.pos // self.block))     # blocks holding [0, pos)
            tail = max(0, s.pos - used * self.block)
            with self._lock:
                if rid in self.records:
                    self.records[rid].last_used = time.time()
                    job.written.add(s.pos)
                    continue
                missing = [j for j in range(used) if ids[j] not in self.blocks]
                need = len(missing) * (per_token + 4) * self.block + 4096 + \
                    (per_token + 4) * tail + sum(t.nbytes for t in s.tensors.values())
                if not self._make_room(need, set(ids[:used])):
                    self.counters["rejected"] += 1
                    continue
            for j in missing:
                self._write_block(job, j, ids)
            start = used * self.block
            tensors, desc = _record_tensors(job, s, start)
            desc.update(format=diskfmt.FORMAT, key=self.salt, block_tokens=self.block,
                        kind="record", layout=self.layout, blocks=ids[:used], id=rid)
            size = diskfmt.write(self.root / "records" / (rid + diskfmt.SUFFIX), tensors, desc)
            diskfmt.sync_dir(self.root / "records")
            rec = Record(rid, s.pos, tuple(ids[:used]), job.tokens[start:s.pos].copy(), size,
                         s.trimmable, time.time())
            with self._lock:
                self.add_record(rec)
                self.counters["written_bytes"] += size
                self.counters["written_records"] += 1
                job.written.add(s.pos)

    def _write_block(self, job: Job, j: int, ids: list[str]) -> None:
        lo, hi = j * self.block, (j + 1) * self.block
        tensors = {f"{i}.{b}": buf[..., lo:hi, :] for i, bufs in job.kv.items()
                   for b, buf in enumerate(bufs)}
        tensors["tokens"] = job.tokens[lo:hi]
        desc = {"format": diskfmt.FORMAT, "key": self.salt, "block_tokens": self.block,
                "kind": "block", "id": ids[j], "parent": ids[j - 1] if j else None,
                "dtypes": job.kv_dtypes}
        size = diskfmt.write(self.root / "blocks" / (ids[j] + diskfmt.SUFFIX), tensors, desc)
        diskfmt.sync_dir(self.root / "blocks")
        with self._lock:
            self.blocks[ids[j]] = Block(size, job.tokens[lo:hi].copy())
            self.bytes_used += size
            self.counters["written_bytes"] += size
            self.counters["written_blocks"] += 1

    # --- index (caller holds the lock, or is the constructor) -------------------------------
    def add_record(self, rec: Record) -> None:
        """Index `rec`; its gap is measured to the nearest record below it on its prefix
        (found through the key index, not a scan: thousands of records index at start)."""
        parent = 0
        whole = min(rec.pos // self.block, len(rec.blocks))
        for key in reversed((None, *rec.blocks[:whole])):   # deepest first: stop at a hit
            for other in self._by_key.get(key, {}).values():
                if parent < other.pos < rec.pos and diskrec.is_prefix(other, rec, self.blocks,
                                                                       self.block):
                    parent = other.pos
            if parent:
                break
        rec.gap = rec.pos - parent
        self.records[rec.rid] = rec
        for key in self._keys(rec):
            self._by_key.setdefault(key, {})[rec.rid] = rec
        self.bytes_used += rec.nbytes
        for b in rec.blocks:
            self.blocks[b].refs += 1

    def _keys(self, r: Record) -> list[str | None]:
        """Where a lookup finds `r`: under the last whole block before its position (a prompt
        whose chain holds that block matches `r` up to there; the rest is compared); a
        trimmable record, which also serves shorter prefixes, under each of those blocks."""
        whole = min(r.pos // self.block, len(r.blocks))
        if whole == 0:
            return [None]
        return list(r.blocks[:whole]) if r.trimmable else [r.blocks[whole - 1]]

    def _unindex(self, r: Record) -> None:
        for key in self._keys(r):
            bucket = self._by_key.get(key)
            if bucket is not None:
                bucket.pop(r.rid, None)
                if not bucket:
                    del self._by_key[key]

    def _make_room(self, need: int, keep: set[str]) -> bool:
        if need > self.budget:
            return False
        if self.bytes_used + need > self.budget:     # blocks of a write that failed midway
            for bid in [b for b, blk in self.blocks.items() if blk.refs <= 0 and b not in keep]:
                (self.root / "blocks" / (bid + diskfmt.SUFFIX)).unlink(missing_ok=True)
                self.bytes_used -= self.blocks.pop(bid).nbytes
        while self.bytes_used + need > self.budget:
            order = sorted(self.records.values(), key=lambda r: -r.last_used)
            rank = {r.rid: i + 1 for i, r in enumerate(order)}
            victims = [r for r in order if not self._pinned[r.rid]]
            if not victims:
                return False
            victim = min(victims, key=lambda r: (r.gap / rank[r.rid], r.last_used))
            self._evict(victim, keep)
        return True

    def _evict(self, r: Record, keep: set[str]) -> None:
        del self.records[r.rid]
        self._unindex(r)
        for other in self.records.values():   # its children now reach further down
            if other.pos > r.pos and other.pos - other.gap == r.pos:
                other.gap += r.gap
        (self.root / "records" / r.path_name).unlink(missing_ok=True)
        self.on_evict(diskrec.tokens(r, self.blocks), r.pos)
        self._release(r, keep)
        self.counters["evicted_records"] += 1

    def _release(self, r: Record, keep: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.bytes_used -= r.nbytes
        for b in r.blocks:
            blk = self.blocks.get(b)
            if blk is None:
                continue
            blk.refs -= 1
            if blk.refs <= 0 and b not in keep:
                (self.root / "blocks" / (b + diskfmt.SUFFIX)).unlink(missing_ok=True)
                del self.blocks[b]
                self.bytes_used -= blk.nbytes


class DirectoryInUse(OSError):
    """Another live worker owns this cache directory."""


def _own(root: Path) -> Any:
    """Hold an exclusive lock on the directory for this process's life (the OS drops it when
    the process dies, SIGKILL included): one writer and one index per directory, so budgets
    and evictions never fight. A second worker of the same model runs without a disk tier."""
    import fcntl

    f = open(root / "lock", "a+")  # noqa: SIM115 - held open for the process's life
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        raise DirectoryInUse(f"{root} is in use by another worker") from e
    return f


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
