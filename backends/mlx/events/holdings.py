"""What each tier restores, as token paths with their restore positions (the input of
`kvevents.forest`), read with the tiers' own rules:

- RAM (`CheckpointStore.lookup`): a finished entry restores its end, each checkpoint, and
  every position up to where its state trims back (the whole entry for plain KV; a
  trimmable checkpoint, an unwrapped window, up to its position). Read on the generation
  thread (the store's), without copying tokens (an entry's list is replaced, never changed).
- disk (`DiskTier.lookup`): a record restores its position, and every one below it when its
  state trims back. Read under the tier's lock; a record's tokens are rebuilt once.

Entries of a cache partition (per-key isolation) are left out: a consumer that rebuilds its
keys from token ids would credit them to every key's requests. They never reach the disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixd.backends.mlx.cache.store import CheckpointStore
from prefixd.backends.mlx.disk.records import tokens as record_tokens

# (tokens, position up to which every prefix restores, exact restore points)
Held = tuple[Sequence[int], int, tuple[int, ...]]


def ram(store: CheckpointStore) -> list[Held]:
    out: list[Held] = []
    for e in store.entries:
        if e.in_progress or e.namespace:
            continue
        trims = len(e.tokens) if e.trimmable else max(
            (p for p, c in e.checkpoints.items() if c.trimmable), default=0)
        out.append((e.tokens, trims, (len(e.tokens), *e.checkpoints)))
    return out


def disk(tier: Any, known: dict[str, Held]) -> dict[str, Held]:
    """record id -> its holding; `known`: those rebuilt before (records never change)."""
    with tier.lock:
        records = list(tier.records.values())
        out: dict[str, Held] = {}
        for r in records:
            held = known.get(r.rid)
            if held is None:
                if any(b not in tier.blocks for b in r.blocks):
                    continue             # a block dropped under it: it is going too
                toks = record_tokens(r, tier.blocks).tolist()
                if len(toks) < r.pos:
                    continue
                held = (toks, r.pos if r.trimmable else 0, (r.pos,))
            out[r.rid] = held
    return out
