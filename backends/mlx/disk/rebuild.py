"""Opening a disk tier: rebuild its index from the files' own descriptions.

Owns: the start-up scan of one cache key's directory. Every file is checked before it joins
the index (a prefixd description of this format, key, block size and cache layout that matches
its checksum; its token ids match theirs; a block's tokens hash to its id; a record's blocks all
present and its tokens hash to its id); anything else is skipped, counted by reason and
summarized in one log line, and never loaded. The tensor data is checked when it is loaded
(`diskfmt.load`): reading every file at start would cost as much as the cache is large.
Leftover temp files (a write cut short by a crash), blocks no record needs and files that can
never load (`BROKEN`: damaged, or records whose blocks are gone) are deleted; files a looser
version left readable by others are made private. Nothing is followed through a link
(`disk/fs.py`): a link is removed and counted `foreign`; a directory or FIFO where a file
belongs is counted and never opened; one bad entry never switches the tier off.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import numpy as np

from prefixd.backends.mlx.disk import chain
from prefixd.backends.mlx.disk import fmt as diskfmt
from prefixd.backends.mlx.disk import fs as diskfs
from prefixd.backends.mlx.disk.index import DiskTier, OnEvict
from prefixd.backends.mlx.disk.records import Block, Record

log = logging.getLogger("prefixd.worker.disk")
BROKEN = ("corrupt", "missing_block")   # skipped files that are deleted (foreign ones stay)


def open_tier(root: Path, salt: str, layout: list[str], budget: int, block: int,
              on_evict: OnEvict | None = None) -> DiskTier:
    """The tier of `root`, indexed, within its budget, its writer started."""
    tier = (DiskTier(root, salt, layout, budget, block) if on_evict is None
            else DiskTier(root, salt, layout, budget, block, on_evict))
    t0 = time.perf_counter()
    index_directory(tier)
    if tier.bytes_used > tier.budget:      # the budget was lowered since the last run
        with tier.lock:
            tier.make_room(0, set())
    tier.start()
    skipped = sum(tier.skipped.values())
    log.info("disk cache: %s: %d records, %d blocks, %.1f MiB of %.1f MiB, indexed in %.2fs%s",
             root, len(tier.records), len(tier.blocks), tier.bytes_used / 2**20,
             tier.budget / 2**20, time.perf_counter() - t0,
             f"; skipped {skipped} files ({_reasons(tier)}): never loaded" if skipped else "")
    return tier


def _reasons(tier: DiskTier) -> str:
    return ", ".join(f"{n} {r}" for r, n in sorted(tier.skipped.items()))


def index_directory(tier: DiskTier) -> None:
    """Fill the index from `blocks/` and `records/` (the tier made them real directories).
    Every entry is looked at without following it: a link is removed (never its target) and
    counted `foreign`, as is anything but a regular file where a cache file belongs (a
    directory, a FIFO: counted, left alone, never opened); an entry that cannot be read is
    counted `unreadable`. No one entry switches the tier off."""
    for path, what in diskfs.entries(tier.root):     # a link of any name goes, unfollowed
        if what == "link":
            diskfs.remove(path, what, tier.skipped)
    found = {sub: _files(tier, tier.root / sub) for sub in ("blocks", "records")}
    blocks = _scan_blocks(tier, found["blocks"])
    for path in found["records"]:
        if path.suffix != diskfmt.SUFFIX:
            tier.skipped["foreign"] += 1
            continue
        try:
            rec = _read_record(tier, path, blocks)
            if isinstance(rec, str):
                _skip(tier, path, rec)
                continue
        except OSError:
            tier.skipped["unreadable"] += 1
            continue
        for b in rec.blocks:
            tier.blocks.setdefault(b, blocks[b])
        tier.add_record(rec)
    for bid, _blk in blocks.items():          # blocks no record needs: free their space
        if bid not in tier.blocks:
            (tier.root / "blocks" / (bid + diskfmt.SUFFIX)).unlink(missing_ok=True)
    tier.bytes_used += sum(b.nbytes for b in tier.blocks.values())


def _files(tier: DiskTier, directory: Path) -> list[Path]:
    """The regular files of `directory` to index, each made the user's only; leftover temp
    files (a write cut short) are deleted, links removed, other entries counted."""
    out = []
    for path, what in diskfs.entries(directory):
        if what == "link":
            diskfs.remove(path, what, tier.skipped)
        elif what != "file":
            tier.skipped["foreign"] += 1
        elif path.name.startswith("."):
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                tier.skipped["partial_write"] += 1
        else:
            try:
                own = diskfs.private_file(path)
            except OSError:                # replaced or unreadable since it was listed
                tier.skipped["unreadable"] += 1
                continue
            if own:
                out.append(path)
            else:                          # a hard link: the name goes, the other stays
                diskfs.remove(path, "link", tier.skipped)
    return out


def _skip(tier: DiskTier, path: Path, reason: str) -> None:
    tier.skipped[reason] += 1
    log.debug("disk cache: skipped %s (%s)", path, reason)
    if reason in BROKEN:
        path.unlink(missing_ok=True)


def _scan_blocks(tier: DiskTier, paths: list[Path]) -> dict[str, Block]:
    found: dict[str, tuple[str | None, np.ndarray, int]] = {}
    for path in paths:
        if path.suffix != diskfmt.SUFFIX:
            tier.skipped["foreign"] += 1
            continue
        try:
            opened = _open(tier, path, "block")
            if isinstance(opened, str) or len(opened[1]) != tier.block:
                _skip(tier, path, opened if isinstance(opened, str) else "corrupt")
                continue
            desc, tokens = opened
            found[path.stem] = (desc.get("parent"), tokens, path.lstat().st_size)
        except OSError:
            tier.skipped["unreadable"] += 1
    # A block is valid when its tokens hash to its id from its parent's (itself valid) id.
    # Iterative (chains of thousands of blocks), each block checked once.
    valid: dict[str, Block] = {}
    status: dict[str, bool] = {}

    def check(bid: str) -> bool:
        path: list[str] = []
        cur: str | None = bid
        while cur is not None and cur not in status and cur in found:
            path.append(cur)
            cur = found[cur][0]
        ok = True if cur is None else status.get(cur, False)   # missing parent: invalid
        for b in reversed(path):
            parent, tokens, size = found[b]
            if ok:
                expected = (chain.block_ids(tier.salt, tokens, tier.block)[0] if parent is None
                            else chain.next_block_id(parent, tokens))
                ok = expected == b
            status[b] = ok
            if ok:
                valid[b] = Block(size, tokens)
        return status[bid]

    for bid in found:
        if not check(bid):
            with contextlib.suppress(OSError):
                _skip(tier, tier.root / "blocks" / (bid + diskfmt.SUFFIX), "corrupt")
    return valid


def _open(tier: DiskTier, path: Path, kind: str) -> tuple[dict, np.ndarray] | str:
    """A file's description and token ids, or why it is skipped (any read error: corrupt)."""
    try:
        desc, f = diskfmt.describe(path)
        with f:
            why = tier.desc_ok(desc, kind)
            if why is not None:
                return why
            tokens = f.get_tensor("tokens")
        diskfmt.verify(path, desc, "tokens", tokens)
    except Exception:            # FormatError, Corrupt, a missing tensor, an unreadable file
        return "corrupt"
    if desc.get("id") != path.stem:
        return "corrupt"
    return desc, chain.as_tokens(tokens)


def _read_record(tier: DiskTier, path: Path, blocks: dict[str, Block]) -> Record | str:
    opened = _open(tier, path, "record")
    if isinstance(opened, str):
        return opened
    desc, tail = opened
    ids = desc.get("blocks") or []
    if any(b not in blocks for b in ids):
        return "missing_block"
    tokens = chain.as_tokens(np.concatenate([blocks[b].tokens for b in ids] + [tail]))
    pos = desc.get("pos")
    used = len(ids) * tier.block
    if not isinstance(pos, int) or not (used - tier.block < pos <= used + len(tail)) or \
            (len(tail) and pos != used + len(tail)) or \
            chain.record_id(tier.salt, tokens[:pos], pos, tier.block, list(ids)) != path.stem:
        return "corrupt"
    st = path.lstat()
    return Record(path.stem, pos, tuple(ids), tail, st.st_size, bool(desc.get("trimmable")),
                  st.st_mtime)
