"""What each mlx-lm cache class allows, and how to copy, trim, snapshot and restore it.

Owns: the table of cache classes prefixd has verified (`KINDS`), flattening `CacheList` into its
leaf caches and rebuilding it, value copies of leaves, checkpoint snapshots and restores, byte
sizes, and KV quantization of a fresh cache. Anything not in `KINDS` is reported by
`unsupported()` so the engine falls back to a cold prefill instead of guessing.

Kinds (checked against mlx-lm 0.32, see docs/CHECKPOINTS.md):
- "kv": `KVCache`, `QuantizedKVCache`: trimmable to any shorter prefix, so an entry's own KV serves
  every checkpoint of it; never snapshotted.
- "window": `RotatingKVCache` (sliding window): trimmable only until the window wraps, so it is
  snapshotted at every checkpoint (a snapshot at p restores p, or any shorter prefix if the
  window had not wrapped at p, as stock mlx-lm trims its prompt caches).
- "state": `ArraysCache` (Gated-DeltaNet, Mamba conv + recurrent state): never trimmable,
  snapshotted at every checkpoint.

Value semantics: `a[i] = x` updates the Python array object `a` in place (it rebinds it to the
updated array), and caches do that to their buffers. Every leaf handed out or stored here is
rebuilt from new array objects, so no array object is ever shared between a stored
entry/snapshot and a live cache. They are shallow (`copy.copy`): MLX arrays are values, so the
new object shares the old data and an in-place update of one copies the buffer first (copy on
write). Snapshots and restores copy nothing; the live cache copies a buffer only when it updates
one in place that a snapshot still holds (a sliding window during decode), and most updates
replace arrays anyway (recurrent state, prefill concatenation).
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

KINDS: dict[type[Any], str] = {
    KVCache: "kv",
    QuantizedKVCache: "kv",
    RotatingKVCache: "window",
    ArraysCache: "state",
}

Cache = list[Any]
Snapshot = dict[int, Any]  # leaf index -> leaf cache copy


class RestoreError(RuntimeError):
    """A restore was asked for a position the stored state cannot produce."""


def leaves(cache: Cache) -> list[Any]:
    """The leaf caches of a model cache, `CacheList`s expanded in order."""
    out: list[Any] = []
    for c in cache:
        out.extend(leaves(list(c.caches)) if type(c) is CacheList else [c])
    return out


def rebuild(template: Cache, new_leaves: list[Any]) -> Cache:
    """A cache shaped like `template` (same `CacheList` nesting) holding `new_leaves`."""
    return _build(template, iter(new_leaves))


def _build(items: list[Any], it: Any) -> list[Any]:
    # Not a closure calling itself: that is a reference cycle, and the leaves it reaches would
    # wait for Python's cycle collector (device memory held after a request ends).
    return [CacheList(*_build(list(c.caches), it)) if type(c) is CacheList else next(it)
            for c in items]


def unsupported(cache: Cache) -> str | None:
    """Why this cache cannot be checkpointed (an unverified class, batch state), else None."""
    for leaf in leaves(cache):
        if type(leaf) not in KINDS:
            return f"unknown cache class {type(leaf).__name__}"
        padded = type(leaf) is ArraysCache and any(
            x is not None for x in (leaf.left_padding, leaf.lengths))
        if padded:
            return "ArraysCache with batch padding"
    return None


def trims(leaf: Any) -> bool:
    """Whether a leaf is full-attention KV (alone or a decode batch's), which trims back to any
    shorter prefix; the rest are windows and states."""
    return KINDS.get(type(leaf)) == "kv" or isinstance(leaf, BatchKVCache)


def own_row(leaf: ArraysCache, row: int = 0) -> ArraysCache:
    """Row `row` of a (batched) recurrent or convolution leaf, in arrays of its own (not views
    that would keep the whole batch's alive), evaluated."""
    out = ArraysCache(len(leaf.cache))
    out.cache = [None if a is None else mx.take(a, mx.array([row]), axis=0) for a in leaf.cache]
    mx.eval([a for a in out.cache if a is not None])
    return out


def snapshot_indices(cache: Cache) -> tuple[int, ...]:
    """Leaves a checkpoint must hold (everything the entry's KV cannot serve by trimming)."""
    return tuple(i for i, leaf in enumerate(leaves(cache)) if KINDS[type(leaf)] != "kv")


def _copy_state(x: Any) -> Any:
    if isinstance(x, mx.array):
        return copy.copy(x)  # a new array object on the same data (see the module docstring)
    if isinstance(x, list | tuple):
        return type(x)(_copy_state(v) for v in x)
    return x


def copy_leaf(leaf: Any) -> Any:
    """A value copy of one leaf cache (new array objects sharing the contents)."""
    return type(leaf).from_state(_copy_state(leaf.state))


def nbytes(cache: Cache) -> int:
    return sum(leaf.nbytes for leaf in leaves(cache))


def evaluate(cache: Cache, *also: Any) -> None:
    """Materialize the cache (and `also`, e.g. logits: one sync) so stored copies hold data,
    not lazy graphs of the prefill."""
    mx.eval([leaf.state for leaf in leaves(cache)], *[a for a in also if a is not None])


def trimmable(cache: Cache) -> bool:
    """Whether every leaf can be trimmed back to any shorter prefix right now."""
    return all(leaf.is_trimmable() for leaf in leaves(cache))


def take(cache: Cache, indices: tuple[int, ...]) -> tuple[Snapshot, int]:
    """Snapshot the given leaves of a live (evaluated) cache: (payload, bytes)."""
    all_leaves = leaves(cache)
    snap = {i: copy_leaf(all_leaves[i]) for i in indices}
    return snap, payload_bytes(snap)


def rewound(cache: Cache, snap: Snapshot, drop: int) -> Cache:
    """`cache` taken back `drop` positions to where `snap` was taken of it: the snapshotted
    leaves replaced by copies of theirs, the others (trimmable) trimmed."""
    new = []
    for i, leaf in enumerate(leaves(cache)):
        if i in snap:
            new.append(copy_leaf(snap[i]))
        else:
            leaf.trim(drop)
            new.append(leaf)
    return rebuild(cache, new)


def payload_bytes(snap: Snapshot) -> int:
    return sum(leaf.nbytes for leaf in snap.values())


def snapshot_trimmable(snap: Snapshot) -> bool:
    """Whether every leaf of a snapshot can be trimmed back to any shorter prefix (never a
    recurrent state; a sliding window only before it wraps)."""
    return all(leaf.is_trimmable() for leaf in snap.values())


def trimmable_below(cache: Cache, indices: tuple[int, ...]) -> int:
    """The smallest sliding window when windows are the only snapshotted leaves (a snapshot
    taken below it can be trimmed back to any shorter prefix), else 0."""
    all_leaves = leaves(cache)
    picked = [all_leaves[i] for i in indices]
    if not picked or any(type(leaf) is not RotatingKVCache for leaf in picked):
        return 0
    return min(leaf.max_size for leaf in picked)


def checkpoint_bytes(probe: Cache, indices: tuple[int, ...], chunk: int) -> int:
    """The largest a checkpoint of these leaves gets, from a cache that has run one token.

    A recurrent state has its full size from the first token. A sliding window grows up to its
    `max_size`, and after a prefill chunk of `chunk` tokens holds up to `max_size + chunk - 1`.
    """
    all_leaves = leaves(probe)
    total = 0
    for i in indices:
        leaf = all_leaves[i]
        if type(leaf) is RotatingKVCache and leaf.keys is not None:
            per_token = leaf.nbytes / max(1, leaf.keys.shape[2])
            total += int(per_token * (leaf.max_size + chunk - 1))
        else:
            total += leaf.nbytes
    return total


def _cut(x: Any, n: int) -> Any:
    """A compact copy of the first `n` positions (axis -2) of a buffer or a quantized triple."""
    if isinstance(x, tuple):
        return tuple(_cut(v, n) for v in x)
    return mx.array(x[..., :n, :])


def _trim_to(c: Any, i: int, pos: int) -> None:
    """Trim the fresh leaf copy `c` (leaf `i`) back to `pos`, then drop the buffer past `pos`: a
    KV trimmed from a long entry would otherwise carry (and be stored with) its whole buffer."""
    extra = getattr(c, "offset", pos) - pos
    if extra < 0 or (extra > 0 and not c.is_trimmable()):
        raise RestoreError(f"leaf {i} ({type(c).__name__}) cannot go back to {pos}")
    if extra and c.trim(extra) != extra:
        raise RestoreError(f"leaf {i} ({type(c).__name__}) trimmed short")
    if extra and type(c) is RotatingKVCache and c._idx != pos:
        raise RestoreError(f"leaf {i} (RotatingKVCache) trimmed to slot {c._idx}, wanted {pos}")
    if extra and type(c) in (KVCache, QuantizedKVCache, RotatingKVCache) and c.keys is not None:
        # As after a cold prefill of `pos` tokens: a buffer of exactly `pos` positions.
        c.keys, c.values = _cut(c.keys, pos), _cut(c.values, pos)


def window_goes_back(leaf: Any, n: int) -> bool:
    """Whether a sliding window (`RotatingKVCache`) can go back by its last `n` positions by
    a cut (`window_back`): it still holds the `max_size - 1` before them (all of them, short
    of a window) in temporal order, as a multi-token pass leaves it (`max_size - 1` plus the
    pass's positions); not after one-token steps rotated it."""
    if type(leaf) is not RotatingKVCache or leaf.keys is None or leaf.keep:
        return False
    size = leaf.keys.shape[2]
    return leaf._idx == size and n <= size and size - n >= min(leaf.max_size - 1,
                                                               leaf.offset - n)


def window_back(leaf: Any, n: int) -> None:
    """`leaf` (`window_goes_back`) trimmed by `n` and cut to its end, in place: it holds what
    one-token steps would have left it to attend to."""
    leaf.trim(n)
    leaf.keys, leaf.values = _cut(leaf.keys, leaf._idx), _cut(leaf.values, leaf._idx)


def compact(leaf: Any, pos: int) -> None:
    """Drop a full-attention leaf's buffer capacity past `pos` (its positions), in place."""
    if type(leaf) in (KVCache, QuantizedKVCache) and leaf.keys is not None:
        k = leaf.keys[0] if isinstance(leaf.keys, tuple) else leaf.keys
        if k.shape[-2] > pos:
            leaf.keys, leaf.values = _cut(leaf.keys, pos), _cut(leaf.values, pos)


def trim_padding(cache: Cache) -> None:
    """Drop the unused capacity of a finished cache's KV buffers before it is stored, in place.

    mlx-lm grows a KV buffer 256 positions at a time, so a 60-token conversation holds 256
    positions (4x its state). A buffer is cut to its positions when the unused part is more than
    an eighth of it: the padding is under 256 positions, so the cut copies at most ~2,000
    positions per buffer, and a longer buffer (under 12.5% padding) is kept as it is rather
    than copied. A sliding window is cut only before it wraps (its positions are then its
    first `offset` slots); a wrapped one is full. The cut copies are evaluated, so the
    padded buffers are freed now, not when the stored state is next used."""
    cut = []
    for leaf in leaves(cache):
        if type(leaf) not in (KVCache, QuantizedKVCache, RotatingKVCache) or leaf.keys is None:
            continue
        k = leaf.keys[0] if isinstance(leaf.keys, tuple) else leaf.keys
        cap, pos = k.shape[-2], leaf.offset
        if type(leaf) is RotatingKVCache and (pos >= leaf.max_size or leaf._idx != pos):
            continue
        if (cap - pos) * 8 > cap:
            leaf.keys, leaf.values = _cut(leaf.keys, pos), _cut(leaf.values, pos)
            cut.append((leaf.keys, leaf.values))
    mx.eval(cut)


def restore(entry_cache: Cache, snap: Snapshot | None, pos: int) -> Cache:
    """A fresh live cache at `pos`: snapshot leaves from `snap`, the rest from the entry, each
    trimmed to `pos` if it is past it (a trimmable snapshot may be taken above `pos`).

    Raises RestoreError if a leaf cannot be brought to `pos` (never returns a wrong state).
    Trimming acts on a fresh copy, so the stored entry and snapshot stay intact.
    """
    out = []
    for i, leaf in enumerate(leaves(entry_cache)):
        c = copy_leaf(snap[i] if snap is not None and i in snap else leaf)
        _trim_to(c, i, pos)
        if hasattr(c, "offset") and c.offset != pos:
            raise RestoreError(f"leaf {i} ({type(c).__name__}) at {c.offset}, wanted {pos}")
        out.append(c)
    return rebuild(entry_cache, out)


def quantize_kv(cache: Cache, bits: int, group_size: int) -> Cache:
    """Replace the empty full-attention `KVCache` leaves by `QuantizedKVCache`s.

    Sliding-window (`RotatingKVCache`) leaves stay full precision: mlx-lm cannot quantize them.
    """
    new = [QuantizedKVCache(group_size=group_size, bits=bits)
           if type(leaf) is KVCache and leaf.empty() else leaf for leaf in leaves(cache)]
    return rebuild(cache, new)
