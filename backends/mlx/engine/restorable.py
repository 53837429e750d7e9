"""What the worker can restore of one request's tokens right after it: the `restorable` digest
its response carries (in `prefixd`, beside `usage`), so a proxy's prefix index learns the
prefixes this worker really restores instead of assuming every message boundary is one.

Owns: reading the checkpoint store (`cache/store.py`) for the prefixes of the request's stored
tokens (prompt + reply, as committed) that a later prompt extending them would restore, with the
store's own rules (`CheckpointStore.lookup`):

- an entry whose state trims to any shorter prefix (every layer a plain KV cache, or a sliding
  window that has not wrapped) restores every prefix it shares with the tokens;
- otherwise, its stored end when the tokens extend it, and each checkpoint at or below the shared
  prefix; a trimmable checkpoint (an unwrapped window) also serves every prefix below it, and
  one above the shared prefix serves the shared prefix itself.

The digest: `positions` (ascending token counts; the `MAX_POSITIONS` highest), `prefix_to`
(every prefix up to it restores too: a trimmable state), `any_prefix` (`prefix_to` reaches the
highest position: a pure-KV model, whose positions are then just the stored length) and
`boundaries` (the positions of its message marks, its checkpoints at message starts and ends
rather than inside a message: where a proxy's estimated boundary most likely really is).

RAM only. The disk tier (when on) is written from these same RAM entries and checkpoints (after
the write delay, or when the RAM budget evicts them), so it will hold these positions and
possibly older ones; records only on disk are not listed (finding them hashes the whole token
chain): the digest may understate, never overstate, what the worker restores now.

Runs on the generation thread (the store's one thread), right after the request's commit. Cheap:
no token copies; the committed entry is read directly, and other entries are compared to it only
when they hold trimmable state and it does not (it then restores every prefix itself), since
`CheckpointStore.finish` has just moved every checkpoint of theirs on the shared prefix into the
committed entry (and absorbed the entries it extends).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from prefixd.backends.mlx.cache.placement import common_prefix
from prefixd.backends.mlx.cache.store import CheckpointStore, Entry

log = logging.getLogger("prefixd.worker.cache")

MAX_POSITIONS = 64  # the highest ones: a next turn or an edit of a late message uses those


def _points(e: Entry, tokens: Sequence[int], lcp: int) -> list[tuple[int, bool]]:
    """(position, also serves every shorter prefix) of `e` for a prompt sharing `lcp` tokens."""
    if lcp <= 0:
        return []
    if e.trimmable:
        return [(min(lcp, len(e.tokens)), True)]
    out = [(len(e.tokens), False)] if len(e.tokens) <= lcp else []
    for p, c in e.checkpoints.items():
        if p <= lcp:
            out.append((p, c.trimmable))
        elif c.trimmable:        # on the entry's path: trimmed to the shared prefix, it is that
            out.append((lcp, True))
    return out


def restorable(store: CheckpointStore, entry: Entry | None) -> dict[str, Any]:
    """The digest for `entry`'s tokens (the request just committed; None: nothing stored)."""
    points: list[tuple[int, bool]] = []
    if entry is not None:
        tokens = entry.tokens
        # not stored: the budget rejected it, or its state was unknown (discarded); then every
        # other entry may still hold some of its prefixes
        stored = entry in store.entries and not entry.in_progress
        for e in store.entries:
            if e.in_progress or e.namespace != entry.namespace or (
                    stored and entry.trimmable and e is not entry):
                continue                       # a trimmable entry restores all it can alone
            if e is entry:
                points += _points(e, tokens, len(tokens))
            elif not stored or e.trimmable or any(c.trimmable for c in e.checkpoints.values()):
                points += _points(e, tokens, common_prefix(e.tokens, tokens))
    prefix_to = max((p for p, trims in points if trims), default=0)
    positions = sorted({p for p, _ in points if p > 0})[-MAX_POSITIONS:]
    # where the request's messages start or end (its checkpoints there, not its in-message
    # interval marks): what a proxy's boundary estimate is snapped to
    marks = sorted(p for p, c in entry.checkpoints.items() if not c.interval) \
        if entry is not None else []
    return {"positions": positions, "prefix_to": prefix_to,
            "any_prefix": bool(positions) and prefix_to >= positions[-1],
            "boundaries": marks[-MAX_POSITIONS:]}


def digest(store: CheckpointStore, entry: Entry | None) -> dict[str, Any] | None:
    """`restorable` for a request just committed (its own entry, `engine.Turn.entry`: other
    jobs may have begun entries since); None if reading the store failed (logged): a failure
    costs the digest, not the reply."""
    try:
        return restorable(store, entry)
    except Exception:
        log.exception("worker: the restorable digest failed; the reply goes without it")
        return None
