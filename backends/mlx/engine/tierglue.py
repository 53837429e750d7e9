"""The Engine's side of the two tiers: opens the disk tier for a model, restores from it, feeds
it, and reports every miss (generation thread).

Owns: the cache key of a model (`DiskSpec.model_id` + the cache layout + format + the settings that
change what is stored), the disk restore with its fallback, the per-request tier and miss reason in
`PromptStats`, and the tier metrics. Policy (when to write, whether a load is worth it, why a lookup
fell short) is `disk/tiers.py`; files are `disk/index.py`/`disk/fmt.py`/`disk/persist.py`.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import RotatingKVCache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.cache.store import CheckpointStore, Entry
from prefixd.backends.mlx.disk import chain
from prefixd.backends.mlx.disk import fmt as diskfmt
from prefixd.backends.mlx.disk import fs as diskfs
from prefixd.backends.mlx.disk.persist import LoadError, load_record
from prefixd.backends.mlx.disk.rebuild import open_tier
from prefixd.backends.mlx.disk.records import Record
from prefixd.backends.mlx.disk.tiers import Tiers, now
from prefixd.backends.mlx.engine.stats import PromptStats
from prefixd.backends.mlx.group.lockstep import Lockstep
from prefixd.metrics import worker as metrics

log = logging.getLogger("prefixd.worker.disk")


@dataclass(frozen=True)
class DiskSpec:
    """Where and how much: `base` holds one directory per cache key."""

    base: Path
    model_id: str             # `model_fingerprint` of the model folder
    budget: int
    write_delay: float = 2.0
    block: int = 256


@dataclass(frozen=True)
class Restore:
    cache: list[Any]
    pos: int


def model_fingerprint(target: str, *extra: object) -> str:
    """What identifies a model's files cheaply: config and tokenizer files whole, each weight
    file by name, size and its first and last MiB (hashing 20 GB of weights at every start
    would take longer than loading them); a Hub id by its name. `extra`: anything else that
    changes the weights (dequantizing)."""
    h = hashlib.blake2b(json.dumps([str(x) for x in extra]).encode(), digest_size=16)
    folder = Path(target)
    if not folder.is_dir():
        h.update(target.encode())
        return h.hexdigest()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        h.update(path.name.encode())
        size = path.stat().st_size
        h.update(size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            if path.suffix in (".json", ".jinja", ".model", ".txt") and size < 64 * 2**20:
                h.update(f.read())
            elif path.suffix in (".safetensors", ".gguf", ".npz", ".bin"):
                h.update(f.read(2**20))
                f.seek(max(0, size - 2**20))
                h.update(f.read(2**20))
    return h.hexdigest()


def layout(template: list[Any]) -> list[str]:
    """What a stored state's shape depends on, leaf by leaf."""
    out = []
    for leaf in snapshot.leaves(template):
        name = type(leaf).__name__
        if type(leaf) is RotatingKVCache:
            name += f":{leaf.max_size}:{leaf.keep}"
        out.append(name)
    return out


def cache_key(spec: DiskSpec, shape: list[str], kv_bits: int | None) -> str:
    blob = json.dumps([spec.model_id, diskfmt.FORMAT, shape, kv_bits, spec.block])
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


class TierGlue:
    def __init__(self, store: CheckpointStore, template: list[Any], spec: DiskSpec | None,
                 snap_idx: tuple[int, ...], config: Any,
                 lockstep: Lockstep | None = None) -> None:
        self.lockstep = lockstep or Lockstep()
        leaves = snapshot.leaves(template)
        kv_idx = [i for i in range(len(leaves)) if i not in snap_idx]
        self.tiers = Tiers(None, kv_idx, snap_idx, spec.write_delay if spec else 0.0,
                           store.budget)
        self.store = store
        if spec is not None and spec.budget > 0:
            shape = layout(template)
            key = cache_key(spec, shape, getattr(config, "kv_bits", None))
            try:
                # every model's prompts: a real directory (a link there is removed), the
                # user's only; cache_dir above it may be a link the operator made
                spec.base.parent.mkdir(parents=True, exist_ok=True)
                found = collections.Counter[str]()
                diskfs.claim_dir(spec.base, found)
                self.tiers.disk = open_tier(spec.base / key, key, shape, spec.budget,
                                            spec.block, on_evict=self.tiers.disk_evicted)
                self.tiers.disk.skipped.update(found)
            except OSError as e:
                log.warning("disk cache off: cannot use %s (%s)", spec.base / key, e)
        store.on_remove = self.tiers.removed
        store.on_drop = self.tiers.dropped
        self._written = 0

    @property
    def disk(self) -> Any:
        return self.tiers.disk

    # --- restore ----------------------------------------------------------------------------
    def restore(self, prompt: list[int], ram_pos: int, stats: PromptStats,
                fresh: Callable[[], list[Any]], count: bool = True,
                namespace: str = "", shared: int = 0) -> Restore | None:
        """A live cache from disk when the disk tier holds a longer prefix worth loading, else
        None (the RAM match, if any, is used). Sets the request's tier, known tokens and miss;
        counts them in the tier metrics unless `count` is False (an export, not a request).
        `shared`: prompt tokens a RAM entry holds on its path; past what any tier restores,
        they are a miss too (`not_restorable`: that entry's state is past them, its
        recurrent or window layers cannot go back, and no checkpoint lies between)."""
        tally = self._count if count else lambda stats, restored: None
        d = self.tiers.decide(prompt, ram_pos, namespace)
        stats.known_tokens, stats.miss = d.known, d.reason
        if shared > d.known:
            stats.known_tokens, stats.miss = shared, "not_restorable"
        stats.tier = "ram" if ram_pos else None
        # the leader's choice (in one process: this one's); each rank of a group loads its
        # own record of that prefix (its layers); unless every rank did, none uses it and the
        # request restores from RAM (the same on every rank), the miss named `group_disk`
        pos = self.lockstep.leader(d.disk[1] if d.disk is not None else 0)
        if not pos:
            tally(stats, ram_pos)
            return None
        if d.disk is not None and d.disk[1] == pos:
            found: tuple[Record, int] | None = d.disk
        else:
            found = self.disk.lookup(chain.as_tokens(prompt[:pos + 1])) if self.disk else None
        loaded = self._load(found[0], pos, fresh, stats) \
            if found is not None and found[1] == pos else None
        if not self.lockstep.all(loaded is not None):
            stats.tier = "ram" if ram_pos else None
            stats.miss = stats.miss or "group_disk"
            tally(stats, ram_pos)
            return None
        tally(stats, pos)
        return loaded

    def _load(self, rec: Record, pos: int, fresh: Callable[[], list[Any]],
              stats: PromptStats) -> Restore | None:
        """`rec` loaded at `pos` (a damaged record is removed), or None with `stats.miss`."""
        t0 = time.perf_counter()
        try:
            cache, nbytes = load_record(self.disk, rec, pos, fresh())
        except LoadError as e:
            log.warning("disk cache: record %s at %d did not load (%s: %s); %s",
                        rec.rid, rec.pos, e.reason, e,
                        "prefilling instead" if e.reason == "disk_evicted" else
                        "removed it, prefilling instead")
            if e.reason != "disk_evicted":
                self.disk.discard(rec, e.reason, e.path)
            stats.miss = e.reason
            return None
        seconds = time.perf_counter() - t0
        stats.disk_load_s, stats.tier = seconds, "disk"
        self.tiers.rates.read(nbytes, seconds)
        metrics.TIER_LOAD_SECONDS.labels("disk").observe(seconds)
        metrics.TIER_READ_BYTES.inc(nbytes)
        return Restore(cache, pos)

    def _count(self, stats: PromptStats, restored: int) -> None:
        if stats.tier:
            metrics.TIER_HITS.labels(stats.tier).inc()
            metrics.TIER_SECONDS_SAVED.labels(stats.tier).inc(
                self.tiers.rates.seconds_for(restored))
        if restored >= stats.known_tokens:
            stats.miss = None
        elif stats.miss is None:
            stats.miss = "restore_error" if stats.fallback else "evicted"
        if stats.miss:
            metrics.TIER_MISSES.labels(stats.miss).inc()
            self.tiers.count_miss(stats.miss)

    def misses(self) -> dict[str, int]:
        return self.tiers.miss_counts()

    def used(self, entry: Entry) -> None:
        self.tiers.hold(entry)

    def prefilled(self, stats: PromptStats) -> None:
        self.tiers.rates.prefilled(stats.recomputed_tokens, stats.prefill_s)

    def prefill_rate(self) -> float | None:
        """The measured prefill rate, tokens/s (None before the first prefill)."""
        return self.tiers.rates.prefill_tps

    # --- writing ----------------------------------------------------------------------------
    def committed(self, entry: Entry) -> None:
        self.tiers.committed(entry, now())
        self._gauges()

    def next_due(self) -> float | None:
        return self.tiers.next_due()

    def due(self, at: float | None = None) -> list[int]:
        """The store positions of the entries due to be written at `at` (a `now()` time; None:
        now). A group's leader journals them: its followers write the same entries."""
        entries = self.tiers.ready(now() if at is None else at)
        return [i for i, e in enumerate(self.store.entries) if e in set(entries)]

    def flush(self, positions: list[int]) -> int:
        """Write the entries at these store positions (`due`)."""
        n = self.tiers.flush([self.store.entries[i] for i in positions
                              if i < len(self.store.entries)])
        self._gauges()
        return n

    def flush_all(self) -> None:
        if self.disk is not None:
            self.tiers.flush_all(list(self.store.entries))

    def close(self, timeout: float) -> bool:
        if self.disk is None:
            return True
        done = self.disk.close(timeout)
        self._gauges()
        return done

    def _gauges(self) -> None:
        metrics.TIER_BYTES.labels("ram").set(self.store.bytes_used)
        if self.disk is None:
            return
        info = self.disk.info()
        metrics.TIER_BYTES.labels("disk").set(info["bytes_used"])
        written = info.get("written_bytes", 0)
        if written > self._written:
            metrics.TIER_WRITTEN_BYTES.inc(written - self._written)
            self._written = written

    def info(self) -> dict[str, Any] | None:
        if self.disk is None:
            return None
        self._gauges()
        r = self.tiers.rates
        return {**self.disk.info(), "write_delay_s": self.tiers.write_delay,
                "waiting_to_write": len(self.tiers.due),
                "misses": self.misses(),
                "prefill_tokens_per_s": round(r.prefill_tps, 1) if r.prefill_tps else None,
                "read_bytes_per_s": round(r.read_bps) if r.read_bps else None}
