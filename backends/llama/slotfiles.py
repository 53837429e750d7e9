"""Slot files: llama-server slots saved into prefixd's disk tier, with an index of the exact
prompt each file holds, so a conversation's prefix outlives its slot, a swap and a restart.

One folder per backend and model fingerprint (`command.fingerprint`: the GGUF file and the
flags that shape its KV), `<cache_dir>/llama-slots/<backend>/<fingerprint>/`; a folder of an
earlier fingerprint is stale (another model file, other flags) and removed. The server
writes and reads the files itself (`--slot-save-path` is that folder). The index
(`index.json`) names each file with its size, its SHA-256 and when it was saved and last used;
the tokens a file holds are read from the file's own header (llama.cpp's `ggsq` state
file), never trusted from the index alone.

A file is restored only after it checks out: present, the size and digest the index recorded,
tokens as its header says. Anything else is a counted miss (`missing`, `damaged`) and the file
is dropped: a miss costs a recompute, never a wrong answer. Files not in the index are not
ours to restore (`foreign`): counted and removed. The disk budget (the worker's
`disk_cache_bytes`) holds: least recently used files go first, and a file whose tokens a newer
file extends is superseded.

Owns: the folder, its index and the counts of what happened to files.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import shutil
import struct
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("prefixd.backend")

MAGIC = 0x67677371          # 'ggsq': llama_state_seq_save_file
INDEX = "index.json"
TOKEN_NULL = -1             # server_tokens::serialize's format marker


def read_tokens(path: Path) -> bytes | None:
    """The token ids a slot file holds (int32, packed), from its header; None when the file
    is not one (or is cut short)."""
    try:
        with path.open("rb") as f:
            head = f.read(12)
            if len(head) < 12:
                return None
            magic, _version, n = struct.unpack("<III", head)
            if magic != MAGIC or n > 1 << 26:
                return None
            packed = f.read(4 * n)
    except OSError:
        return None
    if len(packed) < 4 * n:
        return None
    if n >= 3 and struct.unpack_from("<i", packed)[0] == TOKEN_NULL:
        count = struct.unpack_from("<I", packed, 8)[0]      # marker, version, count, tokens
        if 12 + 4 * count > len(packed):
            return None
        return packed[12:12 + 4 * count]
    return packed                                            # a plain token list (older)


def pack(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def common(a: bytes, b: bytes) -> int:
    """Tokens two packed token lists share at their start (binary search over slices: each
    comparison is a memcmp)."""
    lo, hi = 0, min(len(a), len(b)) // 4
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:4 * mid] == b[:4 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass
class SlotFile:
    name: str
    n_tokens: int
    size: int            # bytes
    sha256: str
    saved_at: float
    used_at: float
    tokens: bytes = field(default=b"", repr=False, compare=False)


class SlotFiles:
    """One model's slot files. Methods that read files are blocking: call them in a thread
    (`LlamaBackend` does); the bookkeeping is not thread-safe, so one call at a time."""

    def __init__(self, root: Path, fingerprint: str, budget: int) -> None:
        self.dir = root / fingerprint
        self.budget = budget
        self.files: dict[str, SlotFile] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self.loaded = False

    @property
    def size(self) -> int:
        """Bytes the files take."""
        return sum(f.size for f in self.files.values())

    def load(self) -> None:
        """Read the index once; drop entries whose file is gone, remove files it does not
        name (a save cut short, or not ours)."""
        if self.loaded:
            return
        self.loaded = True
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.parent.iterdir():       # another model file or other flags
            if old != self.dir and old.is_dir():
                self.counts["stale"] += sum(1 for p in old.iterdir() if p.name != INDEX)
                log.info("slot files: removing %s (another model file or other flags)", old)
                shutil.rmtree(old, ignore_errors=True)
        try:
            raw = json.loads((self.dir / INDEX).read_text())
        except (OSError, ValueError):
            raw = {}
        for entry in raw.get("files", []) if isinstance(raw, dict) else []:
            try:
                f = SlotFile(**{k: entry[k] for k in SlotFile.__dataclass_fields__
                                if k != "tokens"})
            except (KeyError, TypeError):
                continue
            path = self.dir / f.name
            tokens = read_tokens(path)
            if tokens is None or len(tokens) // 4 != f.n_tokens or \
                    path.stat().st_size != f.size:
                self.counts["missing" if tokens is None else "damaged"] += 1
                continue
            f.tokens = tokens
            self.files[f.name] = f
        for p in self.dir.iterdir():
            if p.name != INDEX and p.name not in self.files and not p.name.startswith("."):
                self.counts["foreign"] += 1
                log.info("slot files %s: removing %s (not in the index)", self.dir, p.name)
                with contextlib.suppress(OSError):
                    p.unlink()
        self._write_index()

    def best(self, tokens: bytes, whole: bool = False) -> tuple[SlotFile | None, int]:
        """The file sharing the longest start with `tokens`, and how many tokens (`whole`:
        only files whose every token starts `tokens`: a model whose state resumes at its end
        only, `command.WHOLE_ONLY`)."""
        best, n = None, 0
        for f in self.files.values():
            k = common(f.tokens, tokens)
            if whole and k < f.n_tokens:
                continue
            if k > n:
                best, n = f, k
        return best, n

    @staticmethod
    def new_name() -> str:
        return f"{uuid.uuid4().hex}.bin"

    def added(self, name: str, n_saved: int) -> SlotFile | None:
        """The server saved a slot into `name`: index it (digest, header tokens), drop the
        files it supersedes, keep the budget. None when the file does not check out."""
        path = self.dir / name
        tokens = read_tokens(path)
        if tokens is None or len(tokens) // 4 != n_saved:
            self.counts["save_unreadable"] += 1
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        now = time.time()
        f = SlotFile(name, n_saved, path.stat().st_size, digest(path), now, now, tokens)
        for old in list(self.files.values()):
            if common(old.tokens, tokens) == old.n_tokens:     # a prefix of the new one
                self._remove(old, "superseded")
        self.files[name] = f
        self.counts["saved"] += 1
        self._keep_budget(keep=name)
        self._write_index()
        return self.files.get(name)

    def check(self, f: SlotFile) -> str:
        """`hit` when the file is as indexed, else why not (`missing`, `damaged`); a file
        that does not check out is dropped."""
        path = self.dir / f.name
        try:
            size = path.stat().st_size
        except OSError:
            outcome = "missing"
        else:
            ok = size == f.size and read_tokens(path) == f.tokens and digest(path) == f.sha256
            outcome = "hit" if ok else "damaged"
        if outcome != "hit":
            self._remove(f, outcome)
            self._write_index()
        return outcome

    def used(self, f: SlotFile) -> None:
        f.used_at = time.time()
        self._write_index()

    def drop(self, f: SlotFile, why: str) -> None:
        self._remove(f, why)
        self._write_index()

    def _keep_budget(self, keep: str) -> None:
        """Least recently used files go until the files fit; a new file larger than the
        whole budget goes alone (nothing is evicted for it)."""
        if self.files[keep].size > self.budget:
            self._remove(self.files[keep], "evicted")
            return
        for f in sorted(self.files.values(), key=lambda f: f.used_at):
            if self.size <= self.budget:
                break
            if f.name != keep:
                self._remove(f, "evicted")

    def _remove(self, f: SlotFile, why: str) -> None:
        self.files.pop(f.name, None)
        self.counts[why] += 1
        with contextlib.suppress(OSError):
            (self.dir / f.name).unlink()

    def _write_index(self) -> None:
        entries = [{k: v for k, v in asdict(f).items() if k != "tokens"}
                   for f in self.files.values()]
        tmp = self.dir / f".{INDEX}.{os.getpid()}"
        tmp.write_text(json.dumps({"version": 1, "files": entries}))
        tmp.replace(self.dir / INDEX)

    def status(self) -> dict:
        return {"dir": str(self.dir), "files": len(self.files), "bytes": self.size,
                "budget_bytes": self.budget, "tokens": sum(f.n_tokens for f in self.files.values()),
                "counts": dict(self.counts)}
