"""Rows of a decode batch going back, each on its own, to a position of the pass that verified
their drafts (`Batch.verify`): what a batched verify pass needs of every cache kind.

Owns: which batch caches can go back per row (`verifiable`), putting rotated windows in
temporal order before a multi-token pass (`in_order`), and going back (`back`): full-attention
KV trimmed by the fewest dropped, the rest of each row masked where it is (`GappedKVCache`,
`engine/batch/gapped.py`: the batch's own) or rolled into its left padding (a plain `BatchKVCache`:
mlx-lm's own right-padding `finalize`); sliding windows (`BatchRotatingKVCache`)
rolled the same way, never trimmed (the next step's window is cut from the buffer's end);
recurrent and convolution states (`ArraysCache`: Gated-DeltaNet, Mamba, LFM2) replaced row by
row by the state the in-pass tap captured at that row's position (`engine/inpass/captured.py`: kept
from the pass, or computed again for that row alone).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.batch.gapped import GappedKVCache
from prefixd.backends.mlx.engine.inpass.captured import Captured


def verifiable(cache: list[Any], captured: tuple[int, ...]) -> bool:
    """Whether every row of every leaf of a batch `cache` can go back to any position of a
    pass on its own: KV and windows by a roll; recurrent and convolution states when the tap
    captures them for this model (`captured`) and the batch pads none of their rows."""
    for i, leaf in enumerate(snapshot.leaves(cache)):
        kind = type(leaf)
        if kind is ArraysCache:
            if i not in captured or leaf.left_padding is not None or leaf.lengths is not None:
                return False
        elif not isinstance(leaf, BatchKVCache | BatchRotatingKVCache):
            return False
    return True


def in_order(cache: list[Any]) -> None:
    """Windows that one-token steps rotated, in temporal order before a multi-token pass:
    mlx-lm's mask for a multi-token pass over a rotated batch window misses the trim the pass
    is about to make (a padded row then sees one padding position)."""
    for leaf in snapshot.leaves(cache):
        if type(leaf) is BatchRotatingKVCache:
            leaf._temporal_order()


def back(cache: list[Any], kept: list[int], width: int, captured: Captured | None,
         before: snapshot.Snapshot | None = None) -> bool:
    """Row i keeps the first `kept[i]` positions of the last pass (`width` long): its KV
    and window rows past them rolled into its padding, its recurrent and convolution
    states those captured after them (`before` the pass for 0). Whether the batch's gaps
    were squeezed out (`GappedKVCache.drop`)."""
    drops = [width - k for k in kept]
    squeezed = False
    # each row's captured leaves at its position (a replayed state computed for that row)
    at = {row: captured.get(k, row) for row, k in enumerate(kept)
          if 0 < k < width and captured is not None}
    for i, leaf in enumerate(snapshot.leaves(cache)):
        kind = type(leaf)
        if kind is GappedKVCache:
            squeezed |= leaf.drop(drops)     # masked where they are (`engine/batch/gapped.py`)
        elif kind is BatchKVCache:
            drop(leaf, drops)
        elif kind is BatchRotatingKVCache:
            if any(drops):   # no trim: the next step's window is cut from the buffer's end
                leaf._lengths = leaf.offset - mx.array(drops)
                leaf.finalize()
        else:
            srcs = [at[row][i].cache if row in at else
                    [e[row:row + 1] for e in (leaf if k == width else (before or {})[i]).cache]
                    for row, k in enumerate(kept)]
            leaf.cache = [mx.concatenate([src[e] for src in srcs])
                          for e in range(len(leaf.cache))]
    return squeezed


def drop(leaf: BatchKVCache, drops: list[int]) -> None:
    """Drop the last `drops[i]` positions of row i: all rows by the fewest (a trim), the rest
    rolled to the row's left, into its padding (mlx-lm's own `finalize` of right padding)."""
    least = min(drops)
    if least:
        leaf.trim(least)
    rest = [d - least for d in drops]
    if any(rest):
        leaf.prepare(right_padding=rest)
        leaf.finalize()
