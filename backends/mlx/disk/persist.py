"""Moving cache state between the RAM store and the disk tier (generation thread side).

Owns: building a writer `Job` from a stored entry (numpy views of its evaluated arrays: no copy
and no mlx call on the writer thread; states already on disk are left out) and loading a disk
record back into a live cache at a position (`snapshot.restore` then trims and checks it, as
for a RAM restore). Which entries to write and when is `disk/tiers.py`; the files are `disk/fmt.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.cache.store import Entry
from prefixd.backends.mlx.disk import chain
from prefixd.backends.mlx.disk import fmt as diskfmt
from prefixd.backends.mlx.disk.index import DiskTier
from prefixd.backends.mlx.disk.records import Record
from prefixd.backends.mlx.disk.writer import Job, State


class LoadError(RuntimeError):
    """A record could not be loaded: `reason` names the miss (`disk_evicted`: gone before it
    was read; `corrupt`: a file that does not match its checksums, `path`; `format_mismatch`:
    files that do not rebuild the state they describe)."""

    def __init__(self, reason: str, why: str, path: Path | None = None) -> None:
        super().__init__(why)
        self.reason, self.path = reason, path


def make_job(tier: DiskTier, entry: Entry, kv_idx: Sequence[int], snap_idx: Sequence[int],
             reason: str, only: dict[int, Any] | None = None) -> Job | None:
    """A job writing `entry`'s end state and its checkpoints (or only the snapshots `only`,
    position -> payload) that are not on disk yet; None if there is nothing to write."""
    if entry.payload is None or not entry.tokens:
        return None
    tokens = chain.as_tokens(entry.tokens)
    wanted = only if only is not None else \
        {p: c.payload for p, c in entry.checkpoints.items()} | {len(tokens): None}
    ids = chain.block_ids(tier.salt, tokens[:max(wanted, default=0)], tier.block)
    absent = tier.absent({p: chain.record_id(tier.salt, tokens, p, tier.block, ids)
                          for p in wanted})
    wanted = {p: s for p, s in wanted.items() if p in absent}
    if not wanted:
        return None
    leaves = snapshot.leaves(entry.payload)
    kv: dict[int, list[Any]] = {}
    kv_dtypes: dict[str, str] = {}
    for i in kv_idx:
        host: diskfmt.Host = {}
        for b, buf in enumerate(diskfmt.kv_arrays(leaves[i])):
            diskfmt.host(buf, f"{i}.{b}", host, kv_dtypes)
        kv[i] = list(host.values())
    states = []
    for pos, snap in sorted(wanted.items()):
        picked = snap if snap is not None else {i: leaves[i] for i in snap_idx}
        tensors: diskfmt.Host = {}
        dtypes: dict[str, str] = {}
        desc = {i: {"class": type(leaf).__name__,
                    "state": diskfmt.flatten(leaf.state, f"s{i}", tensors, dtypes)}
                for i, leaf in picked.items()}
        trim = all(leaf.is_trimmable() for leaf in picked.values())
        states.append(State(pos, tensors, desc, dtypes, trim))
    return Job(tokens, kv, {i: diskfmt.kv_desc(leaves[i]) for i in kv_idx}, kv_dtypes,
               states, reason)


def load_record(tier: DiskTier, rec: Record, pos: int, template: list[Any]) -> tuple[list[Any],
                                                                                      int]:
    """(a live cache at `pos` rebuilt from `rec` and its blocks, bytes read). LoadError if the
    record is gone, a file does not match its checksums, or the files do not rebuild the state
    they describe. Every file is verified before any of it is used."""
    paths = tier.pin(rec)
    if paths is None:
        raise LoadError("disk_evicted", "evicted from disk")
    try:
        *loaded, (arrays, desc) = diskfmt.load(paths)
        blocks = [blk for blk, _ in loaded]
        if desc.get("id") != rec.rid or desc.get("blocks") != list(rec.blocks):
            raise diskfmt.Corrupt(paths[-1], "not the record the index holds")
        leaves = []
        for i in range(len(tier.layout)):
            d = desc["leaves"][str(i)]
            if "n" in d:
                parts = [[blk[f"{i}.{b}"] for blk in blocks] + [arrays[f"{i}.{b}"]]
                         for b in range(d["n"])]
                leaves.append(diskfmt.kv_leaf(d, parts, rec.pos))
            else:
                leaves.append(diskfmt.state_leaf(d, arrays))
        cache = snapshot.restore(snapshot.rebuild(template, leaves), None, pos)
        snapshot.evaluate(cache)
    except diskfmt.Corrupt as e:
        raise LoadError("corrupt", str(e), e.path) from e
    except Exception as e:
        raise LoadError("format_mismatch", f"{type(e).__name__}: {e}") from e
    finally:
        tier.unpin(rec)
    return cache, sum(p.stat().st_size for p in paths if p.exists())
