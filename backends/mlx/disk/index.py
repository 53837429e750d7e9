"""The disk tier of the worker's prompt cache: an index of block and record files under a byte
budget, its lookups and its eviction.

Owns: the directory of one cache key (`<cache_dir>/prompts/<key>/`: `manifest.json`,
`blocks/`, `records/`) and the lock that makes this process its only user, its in-memory index
(rebuilt from the files' own descriptions at start by `disk/rebuild.py`: no separate index file can
go stale), lookups of the longest restorable prefix, pins, and the disk budget with its
eviction. The generation thread calls `lookup`/`pin` and submits `Job`s (`disk/persist.py`) to the
tier's writer thread (`disk/writer.py`), which does all hashing and file writes. One lock
guards the index; file reads and writes happen outside it.

Eviction (when a write would exceed the budget) drops the records worth least: the tokens they
save beyond the nearest record below them on the same prefix, divided by their recency rank
(the RAM store's rule); a block goes when no record needs it. A file being loaded is pinned and
never evicted under the reader. A file found corrupt when it is loaded is removed with every
record that needs it (`discard`). The directory and its files are the daemon user's only.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Callable, Set
from pathlib import Path
from typing import IO, Any

import numpy as np

from prefixd.backends.mlx.disk import chain
from prefixd.backends.mlx.disk import fmt as diskfmt
from prefixd.backends.mlx.disk import fs as diskfs
from prefixd.backends.mlx.disk import records as diskrec
from prefixd.backends.mlx.disk.records import Block, Record
from prefixd.backends.mlx.disk.writer import DiskWriter, Job

# (tokens, pos, reason) of a record the tier dropped: `disk_evicted` by the budget, `corrupt`
# (its file or one of its blocks did not match its checksums)
OnEvict = Callable[[np.ndarray, int, str], None]
COUNTERS = ("written_bytes", "written_blocks", "written_records", "evicted_records", "rejected",
            "skipped_writes",
            "write_errors")


class DiskTier:
    """One cache key's directory: its index, budget and writer."""

    def __init__(self, root: Path, salt: str, layout: list[str], budget: int, block: int,
                 on_evict: OnEvict = lambda tokens, pos, reason: None) -> None:
        self.root, self.salt, self.layout = root, salt, layout
        self.budget, self.block = budget, block
        self.on_evict = on_evict
        self.records: dict[str, Record] = {}
        self._by_key: dict[str | None, dict[str, Record]] = {}   # see `_keys`
        self.blocks: dict[str, Block] = {}
        self.bytes_used = 0
        self.counters = collections.Counter[str]()   # written_bytes, evicted, rejected, ...
        self.skipped = collections.Counter[str]()    # files never loaded, by reason
        self._pinned: collections.Counter[str] = collections.Counter()
        self.version = 0      # bumped by every record added or dropped (KV event publishing)
        self.lock = threading.Lock()             # the index, and the writer's queue
        for sub in ("", "blocks", "records"):      # real directories (a link is removed)
            diskfs.claim_dir(root / sub, self.skipped)
        self._owner: IO[str] | None = diskfs.own(root, self.skipped)
        self._write_manifest()
        self.writer = DiskWriter(self)

    def start(self) -> None:
        """Start the writer (after `rebuild.index_directory` has filled the index)."""
        self.writer.start()

    def _write_manifest(self) -> None:
        """`manifest.json`, created if absent, never through a link (a link or a directory
        of that name is removed and counted `foreign`; nothing reads it back)."""
        path = self.root / "manifest.json"
        diskfs.claim_file(path, self.skipped)
        if diskfs.kind(path) == "file" and diskfs.private_file(path):
            return
        fd = diskfs.open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "w") as f:
            json.dump({"format": diskfmt.FORMAT, "key": self.salt, "layout": self.layout,
                       "block_tokens": self.block}, f, indent=1)

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
        with self.lock:     # only records whose whole blocks lie on the prompt's chain
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
        with self.lock:
            return {p for p, rid in rids.items() if rid not in self.records}

    def pin(self, r: Record) -> list[Path] | None:
        """Keep `r` and its blocks from eviction while they are read; their paths (record
        last), or None if it is gone. `unpin` afterwards."""
        with self.lock:
            if r.rid not in self.records:
                return None
            self._pinned[r.rid] += 1
            r.last_used = time.time()
        return [self.root / "blocks" / (b + diskfmt.SUFFIX) for b in r.blocks] + \
            [self.root / "records" / r.path_name]

    def unpin(self, r: Record) -> None:
        with self.lock:
            self._pinned[r.rid] -= 1

    def discard(self, r: Record, reason: str, path: Path | None = None) -> None:
        """Record `r` failed to load: drop it from the index and delete its file (its own key,
        so no other version of prefixd wants it), counted under `reason` in `skipped`. If the
        file at fault is one of its blocks (`path`), the block goes too, with every record that
        needs it (counted as `missing_block`; each reported to `on_evict` under `reason`)."""
        with self.lock:
            bid = path.stem if path is not None and path.parent.name == "blocks" else None
            if bid is None or bid not in self.blocks:
                if self._drop(r, reason):
                    self.skipped[reason] += 1
                return
            for other in [o for o in self.records.values() if bid in o.blocks]:
                if self._drop(other, reason):
                    self.skipped["missing_block"] += 1
            blk = self.blocks.pop(bid)
            (self.root / "blocks" / (bid + diskfmt.SUFFIX)).unlink(missing_ok=True)
            self.bytes_used -= blk.nbytes
            self.skipped[reason] += 1

    def _drop(self, r: Record, reason: str) -> bool:
        if self.records.pop(r.rid, None) is None:
            return False
        self.on_evict(diskrec.tokens(r, self.blocks), r.pos, reason)
        self._unindex(r)
        (self.root / "records" / r.path_name).unlink(missing_ok=True)
        self._release(r, keep=set(r.blocks))   # the writer may be about to reference them
        return True

    def submit(self, job: Job) -> None:
        """Queue `job` for the writer (its `done` is set at once if the tier is closed)."""
        self.writer.submit(job)

    def drain(self, timeout: float) -> bool:
        """Wait until every submitted job is written (or `timeout`); False if not all were."""
        return self.writer.drain(timeout)

    def close(self, timeout: float = 0.0) -> bool:
        """Stop the writer (waiting at most `timeout` for its queue); release the directory
        if nothing was left unwritten."""
        done = self.writer.stop(timeout)
        if done and self._owner is not None:
            self._owner.close()           # the next owner may come (a restart in-process)
            self._owner = None
        return done

    def info(self) -> dict[str, Any]:
        with self.lock:
            return {"dir": str(self.root), "bytes_used": self.bytes_used,
                    "bytes_budget": self.budget, "records": len(self.records),
                    "blocks": len(self.blocks), "block_tokens": self.block,
                    "pending_jobs": self.writer.pending(),
                    "skipped_files": dict(self.skipped),
                    **{k: self.counters[k] for k in COUNTERS}}

    # --- index (caller holds the lock, or is the constructor) -------------------------------
    def touch(self, rid: str) -> bool:
        """Whether record `rid` is on disk; if so it counts as just used."""
        rec = self.records.get(rid)
        if rec is not None:
            rec.last_used = time.time()
        return rec is not None

    def add_block(self, bid: str, blk: Block) -> None:
        self.blocks[bid] = blk
        self.bytes_used += blk.nbytes

    def drop_unused(self, bids: Set[str]) -> None:
        """Delete the blocks of `bids` no record needs (written for a record whose write
        failed): nothing on disk is left outside the index and `bytes_used`."""
        for bid in bids:
            blk = self.blocks.get(bid)
            if blk is not None and blk.refs <= 0:
                (self.root / "blocks" / (bid + diskfmt.SUFFIX)).unlink(missing_ok=True)
                self.bytes_used -= self.blocks.pop(bid).nbytes

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
        self.version += 1
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
        self.version += 1
        for key in self._keys(r):
            bucket = self._by_key.get(key)
            if bucket is not None:
                bucket.pop(r.rid, None)
                if not bucket:
                    del self._by_key[key]

    def make_room(self, need: int, keep: set[str]) -> bool:
        if need > self.budget:
            return False
        if self.bytes_used + need > self.budget:     # blocks a discarded record left
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

    def _evict(self, r: Record, keep: Set[str]) -> None:
        del self.records[r.rid]
        self._unindex(r)
        for other in self.records.values():   # its children now reach further down
            if other.pos > r.pos and other.pos - other.gap == r.pos:
                other.gap += r.gap
        (self.root / "records" / r.path_name).unlink(missing_ok=True)
        self.on_evict(diskrec.tokens(r, self.blocks), r.pos, "disk_evicted")
        self._release(r, keep)
        self.counters["evicted_records"] += 1

    def _release(self, r: Record, keep: Set[str] = frozenset()) -> None:
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

