"""The checkpoint store of the mlx worker: pure policy over token lists and byte sizes.

Owns: sequence entries (tokens + the opaque live cache at their end), the checkpoints attached to
them (opaque snapshots of the non-trimmable layers at a position), the longest-common-prefix lookup
that picks the restore point, and the byte budget with its eviction. Where checkpoints go is
`cache/placement.py`. It never imports mlx: payloads are opaque and their sizes are passed in
(`cache/snapshot.py` makes them).

Invariants:
- `bytes_used <= budget` after every call; room is made *before* anything is stored, and an item
  that cannot fit (without evicting something worth more) is not stored and evicts nothing.
- A checkpoint at `pos` in an entry is valid for every entry sharing `tokens[:pos]`: trimmable
  layers come from the owning entry's KV, the rest from the snapshot. So checkpoints move freely
  between entries that share the prefix up to their position. A checkpoint whose snapshotted
  layers are all trimmable (a sliding window that has not wrapped) also serves any shorter prefix.
- Worth of an item = prompt tokens it saves from recomputation / max(1, requests since its entry
  was last used). An entry saves `len(tokens)`; a checkpoint saves the gap to the checkpoint below
  it (counted half for an in-message interval checkpoint, which only edits use). To store an
  item, the cheapest items are evicted only while their worth *together* does not exceed the new
  item's. Dense checkpoints (small gap) therefore go first, then stale or short sequences; a short
  new request of L tokens costs a conversation used by the previous request at most L restorable
  tokens at its message boundaries (2L inside a message).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixd.backends.mlx.cache.placement import common_prefix

# Message boundaries are where new requests diverge (a new conversation after the system prompt,
# the next turn); interval marks only serve edits inside a message. Under pressure, an interval
# checkpoint a few tokens below a boundary must go before the boundary's.
INTERVAL_WEIGHT = 0.5


@dataclass(eq=False)
class Checkpoint:
    pos: int
    payload: Any
    nbytes: int
    interval: bool = False  # an in-message interval mark: only an edit inside a message uses it
    trimmable: bool = False  # every snapshotted layer can be trimmed back (an unwrapped window)


@dataclass(eq=False)
class Entry:
    """A token sequence and (once finished) the live cache at its end, plus its checkpoints."""

    tokens: list[int]
    payload: Any = None
    nbytes: int = 0
    trimmable: bool = False  # every layer of `payload` can be trimmed to any shorter prefix
    checkpoints: dict[int, Checkpoint] = field(default_factory=dict)
    last_used: int = 0
    in_progress: bool = True
    namespace: str = ""      # its cache partition: only requests of the same one use it


@dataclass(frozen=True)
class Match:
    """Where to restore a prompt from: `entry` trimmed to `pos`, or `checkpoint` (at
    `checkpoint.pos >= pos`; trimmed to `pos` when above it)."""

    entry: Entry
    pos: int
    checkpoint: Checkpoint | None
    lcp: int


# (payload, bytes, trimmable) of an entry's end state as a checkpoint, or None
EndSnapshot = Callable[[Entry], tuple[Any, int, bool] | None]


class CheckpointStore:
    """Entries and checkpoints under a byte budget. Single-threaded (the worker's one executor)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.entries: list[Entry] = []
        self.bytes_used = 0
        self.tick = 0
        self.evicted_entries = 0
        self.evicted_checkpoints = 0
        self.rejected = 0
        self.version = 0       # bumped by every change of what is stored (KV event publishing)
        # The last request's entry, even once dropped (its tokens then; `engine/restorable.py`)
        self.latest: Entry | None = None
        # Told what leaves the store: (entry, why: merged | discarded | rejected | evicted),
        # and (entry, position, snapshot) of a checkpoint evicted under budget pressure.
        self.on_remove: Callable[[Entry, str], None] = lambda entry, why: None
        self.on_drop: Callable[[Entry, int, Any], None] = lambda entry, pos, payload: None

    # --- lookup ------------------------------------------------------------------------------
    def lookup(self, prompt: Sequence[int], namespace: str = "") -> Match | None:
        """The restore point reusing the most tokens of `prompt` (at most `len(prompt) - 1`),
        among the entries of its cache partition (`namespace`); its entry is marked used."""
        best = self.peek(prompt, namespace)
        if best is not None:
            best.entry.last_used = self.tick
        return best

    def peek(self, prompt: Sequence[int], namespace: str = "") -> Match | None:
        """`lookup`, marking nothing used (how much a restore would reuse now)."""
        best: Match | None = None
        for e in self.entries:
            if e.in_progress or e.namespace != namespace:
                continue
            lcp = common_prefix(e.tokens, prompt)
            m = self._usable(e, lcp, min(lcp, len(prompt) - 1))
            if m is None:
                continue
            if best is None or (m.pos, e.last_used) > (best.pos, best.entry.last_used):
                best = m
        return best

    def shared(self, prompt: Sequence[int], namespace: str = "") -> int:
        """The most tokens of `prompt` (at most `len(prompt) - 1`) on the token path of a
        stored entry of its partition, restorable there or not (`lookup`'s `pos` is what a
        restore reuses: less where the entry is past them and cannot go back to them)."""
        return max((min(common_prefix(e.tokens, prompt), len(prompt) - 1)
                    for e in self.entries if not e.in_progress and e.namespace == namespace),
                   default=0)

    @staticmethod
    def _usable(e: Entry, lcp: int, limit: int) -> Match | None:
        if limit <= 0:
            return None
        if e.trimmable or len(e.tokens) <= limit:
            return Match(e, min(limit, len(e.tokens)), None, lcp)
        # A trimmable checkpoint above the limit lies on the entry's token path, so trimmed to
        # `limit` (<= lcp) it is the state of the prompt's own prefix: it serves the limit itself.
        above = [c for p, c in e.checkpoints.items() if p > limit and c.trimmable]
        if above:
            return Match(e, limit, min(above, key=lambda c: c.pos), lcp)
        below = [p for p in e.checkpoints if p <= limit]
        if not below:
            return None
        pos = max(below)
        return Match(e, pos, e.checkpoints[pos], lcp)

    # --- storing -----------------------------------------------------------------------------
    def begin(self, tokens: Sequence[int], namespace: str = "") -> Entry:
        """Open the entry of a new request; its checkpoints are added as the prefill takes them."""
        self.tick += 1
        entry = self.latest = Entry(tokens=list(tokens), last_used=self.tick,
                                    namespace=namespace)
        self.entries.append(entry)
        return entry

    def add_checkpoint(self, entry: Entry, pos: int, payload: Any, nbytes: int,
                       interval: bool = False, *, trimmable: bool = False) -> bool:
        """Store a checkpoint of `entry` at `pos` if it fits; False if it was not stored.
        `interval`: an in-message interval mark (worth less than a boundary at the same gap).
        `trimmable`: every snapshotted layer can be trimmed back to any shorter prefix (a
        sliding window that has not wrapped), so the checkpoint also serves positions below."""
        if pos in entry.checkpoints or entry not in self.entries:
            return False
        lower = [p for p in entry.checkpoints if p < pos]
        worth = (pos - max(lower, default=0)) * (INTERVAL_WEIGHT if interval else 1.0)
        if not self._make_room(nbytes, worth, keep=entry):
            return False
        entry.checkpoints[pos] = Checkpoint(pos, payload, nbytes, interval, trimmable)
        self.bytes_used += nbytes
        self.version += 1
        return True

    def finish(self, entry: Entry, tokens: Sequence[int], payload: Any, nbytes: int,
               trimmable: bool, end_snapshot: EndSnapshot) -> bool:
        """Store the cache at the end of `tokens` (what the KV really holds) as `entry`'s payload.

        Entries that are a prefix of `tokens` are absorbed (their end state becomes a checkpoint
        made by `end_snapshot`, their KV is dropped); other entries hand over their checkpoints
        below the shared prefix. False if the entry did not fit (it is then dropped entirely).
        """
        if entry not in self.entries:
            return False
        if not tokens:
            self._remove(entry, "discarded")
            return False
        entry.tokens, entry.trimmable = list(tokens), trimmable
        for pos in [p for p in entry.checkpoints if p >= len(entry.tokens)]:
            self._drop_checkpoint(entry, pos)
        for other in [e for e in self.entries if e is not entry and not e.in_progress
                      and e.namespace == entry.namespace]:
            if other in self.entries:  # an earlier merge may have evicted it to make room
                self._merge_into(entry, other, end_snapshot)
        entry.in_progress = False
        if not self._make_room(nbytes, len(entry.tokens), keep=entry):
            self._remove(entry, "rejected")
            return False
        entry.payload, entry.nbytes = payload, nbytes
        self.bytes_used += nbytes
        self.version += 1
        return True

    def discard(self, entry: Entry) -> None:
        """Drop an entry (e.g. a request that failed with its cache in an unknown state)."""
        if entry in self.entries:
            self._remove(entry, "discarded")

    def _merge_into(self, entry: Entry, other: Entry, end_snapshot: EndSnapshot) -> None:
        lcp = common_prefix(other.tokens, entry.tokens)
        # a checkpoint at entry's very end would duplicate entry's own end state: keep it
        for pos in [p for p in other.checkpoints if p <= lcp and p < len(entry.tokens)]:
            ckpt = other.checkpoints.pop(pos)
            self.version += 1
            if pos in entry.checkpoints:
                self.bytes_used -= ckpt.nbytes
            else:
                entry.checkpoints[pos] = ckpt
        if lcp < len(other.tokens):
            return
        end = len(other.tokens)
        self._remove(other, "merged")
        if 0 < end < len(entry.tokens) and end not in entry.checkpoints and not entry.trimmable:
            snap = end_snapshot(other)
            if snap is not None:
                payload, nbytes, trimmable = snap
                self.add_checkpoint(entry, end, payload, nbytes, trimmable=trimmable)

    # --- budget ------------------------------------------------------------------------------
    def _worth(self, entry: Entry, tokens: int) -> float:
        # The previous request's items count fully (age 1), so the next request of the same
        # conversation does not halve them; older ones decay.
        return tokens / max(1, self.tick - entry.last_used)

    def _cheapest(self, keep: Entry, gone: set[int], dropped: set[tuple[int, int]]
                  ) -> tuple[float, Entry, int | None, int] | None:
        """(worth, entry, checkpoint position or None for the whole entry, bytes freed) of the
        cheapest item still present in the plan, skipping items that free nothing.

        A checkpoint's worth is the gap to the nearest checkpoint below it that the plan keeps,
        so dropping one makes its neighbour dearer: uniform checkpoints thin out evenly.
        """
        best: tuple[float, Entry, int | None, int] | None = None
        for e in self.entries:
            if id(e) in gone:
                continue
            prev, kept = 0, 0
            for pos in sorted(e.checkpoints):
                if (id(e), pos) in dropped:
                    continue
                ckpt = e.checkpoints[pos]
                size = ckpt.nbytes
                kept += size
                w = self._worth(e, pos - prev) * (INTERVAL_WEIGHT if ckpt.interval else 1.0)
                if size > 0 and (best is None or w < best[0]):
                    best = (w, e, pos, size)
                prev = pos
            size = e.nbytes + kept
            if e is not keep and not e.in_progress and size > 0:
                w = self._worth(e, len(e.tokens))
                if best is None or w < best[0]:
                    best = (w, e, None, size)
        return best

    def _make_room(self, nbytes: int, worth: float, keep: Entry) -> bool:
        """Evict the cheapest items until `nbytes` fit, if what they are worth together does not
        exceed `worth` (the new item's); otherwise evict nothing and return False."""
        need = self.bytes_used + nbytes - self.budget
        if need <= 0:
            return True
        if nbytes > self.budget:
            self.rejected += 1
            return False
        plan: list[tuple[Entry, int | None]] = []
        gone: set[int] = set()
        dropped: set[tuple[int, int]] = set()
        spent = 0.0
        while need > 0:
            item = self._cheapest(keep, gone, dropped)
            if item is None or spent + item[0] > worth:
                self.rejected += 1
                return False
            w, e, pos, size = item
            spent, need = spent + w, need - size
            if pos is None:
                gone.add(id(e))
            else:
                dropped.add((id(e), pos))
            plan.append((e, pos))
        for e, pos in plan:
            if pos is None:
                self._remove(e, "evicted")
                self.evicted_entries += 1
            elif e in self.entries and pos in e.checkpoints and id(e) not in gone:
                self.on_drop(e, pos, e.checkpoints[pos].payload)
                self._drop_checkpoint(e, pos)
                self.evicted_checkpoints += 1
        return True

    def _drop_checkpoint(self, entry: Entry, pos: int) -> None:
        self.bytes_used -= entry.checkpoints.pop(pos).nbytes
        self.version += 1

    def _remove(self, entry: Entry, why: str) -> None:
        self.entries.remove(entry)
        self.version += 1
        self.bytes_used -= entry.nbytes + sum(c.nbytes for c in entry.checkpoints.values())
        self.on_remove(entry, why)
        if why in ("rejected", "discarded"):  # never stored: `latest` keeps no snapshots alive
            entry.checkpoints = {}

    # --- reporting ---------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """Counts and sizes for GET /v1/cache."""
        done = [e for e in self.entries if not e.in_progress]
        return {
            "entries": [{"tokens": len(e.tokens), "bytes": e.nbytes, "trimmable": e.trimmable,
                         "checkpoints": sorted(e.checkpoints),
                         "checkpoint_bytes": sum(c.nbytes for c in e.checkpoints.values()),
                         "idle_requests": self.tick - e.last_used} for e in done],
            "checkpoints": sum(len(e.checkpoints) for e in done),
            "bytes_used": self.bytes_used,
            "bytes_budget": self.budget,
            "evicted_entries": self.evicted_entries,
            "evicted_checkpoints": self.evicted_checkpoints,
            "rejected": self.rejected,
        }
