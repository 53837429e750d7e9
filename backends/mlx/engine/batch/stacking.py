"""How a decode batch's caches are put together (`batch.Batch`): which caches can share a pass
at all, the full-attention KV rows of the batch and of the runs joining it stacked into one new
buffer, and the memory a join or leave freed given back at once.

Owns: `GROWTH`, the spare positions a batch's KV buffers grow by.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.batch.gapped import GappedKVCache
from prefixd.backends.mlx.model.memory import trim_heap


def unbatchable(cache: list[Any]) -> str | None:
    """Why decode steps of this model's caches cannot share a pass (a class mlx-lm cannot
    merge, e.g. a quantized KV cache), else None. `cache`: an empty one of the model's."""
    for layer in cache:
        try:
            merged = type(layer).merge([layer])
        except Exception as e:   # no `merge` (AttributeError), or one that cannot
            return f"{type(layer).__name__} cannot merge ({type(e).__name__})"
        for leaf in snapshot.leaves([merged]):
            for method in ("extract", "filter", "extend"):
                if not hasattr(leaf, method):
                    return f"{type(leaf).__name__} has no {method}"
    return None


# Positions a batch's KV buffers grow by when full (mlx-lm's default is 256 for one request):
# each growth adds them to every row, and copies the batch's KV once. 64: a batch of 16 holds at
# most 64 spare positions a row, and copies its KV once every 64 steps.
GROWTH = 64


def release() -> None:
    """The buffers a join or leave freed go back to the system now (MLX's cache, the C heap),
    not at the allocators' leisure."""
    mx.clear_cache()
    trim_heap()


def stackable(batch: Any, joining: list[Any]) -> bool:
    return (batch is None or (isinstance(batch, BatchKVCache) and batch.keys is not None)) and \
        all(type(c) is KVCache and c.keys is not None for c in joining)


def stack(batch: Any, joining: list[Any]) -> Any:
    """The batch's KV rows and the joining runs' in one new `BatchKVCache`, right-aligned at
    the longest and with `GROWTH` spare positions: one new buffer (mlx-lm's `merge` then
    `extend` pad copies of both first, and the first decode step grows it again), so joining
    holds at most the old batch, the joiners and the new batch at once."""
    if isinstance(batch, GappedKVCache):
        batch.compact()
    lengths = [c.offset for c in joining]
    old = 0 if batch is None else batch._idx
    idx = max(old, *lengths)
    first = joining[0].keys
    rows = len(joining) + (0 if batch is None else batch.keys.shape[0])
    keys = mx.zeros((rows, first.shape[1], idx + GROWTH, first.shape[3]), first.dtype)
    vals = joining[0].values
    values = mx.zeros((rows, vals.shape[1], idx + GROWTH, vals.shape[3]), vals.dtype)
    at = 0
    pads, offsets = [], []
    if batch is not None:
        at = batch.keys.shape[0]
        keys[:at, :, idx - old:idx] = batch.keys[..., :old, :]
        values[:at, :, idx - old:idx] = batch.values[..., :old, :]
        pads.append(batch.left_padding + (idx - old))
        offsets.append(batch.offset)
    for j, (c, n) in enumerate(zip(joining, lengths, strict=True)):
        keys[at + j:at + j + 1, :, idx - n:idx] = c.keys[..., :n, :]
        values[at + j:at + j + 1, :, idx - n:idx] = c.values[..., :n, :]
    out: Any = GappedKVCache([0] * rows)
    out.keys, out.values, out._idx = keys, values, idx
    out.left_padding = mx.concatenate([*pads, mx.array([idx - n for n in lengths])])
    out.offset = mx.concatenate([*offsets, mx.array(lengths)])
    return out
