"""The checks an imported bundle's contents must pass before any of it becomes cache state.

Owns: what a bundle may hold, judged as untrusted input against this model: its token ids
(exactly the dtype an export writes, one per position, inside the vocabulary), its tensors
(only the dtypes cache classes hold, every float finite, every one used by exactly one leaf)
and every leaf's state (this model's cache class, structure, array dtypes and shapes for that
many positions, and scalars: sizes, quantization and window equal to this model's, positions
consistent with the bundle's). Every refusal is a `BundleError` with a named `reason`.
Pure checks: nothing here stores anything (`engine/transfer/bundle.py` builds and stores what
passes).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

TOKEN_DTYPE = np.dtype("<i4")         # what `bundle.export` writes
# Host dtypes a cache leaf can hold (bfloat16 travels as its uint16 bits, named in `dtypes`).
HOST_DTYPES = {np.dtype("<f4"): mx.float32, np.dtype("<f2"): mx.float16,
               np.dtype("<u4"): mx.uint32}
BF16_EXPONENT = 0x7F80                # all ones: an infinity or a NaN
POSITIONAL = (KVCache, QuantizedKVCache, RotatingKVCache)   # axis -2 counts positions
# where a leaf's `state` holds positions (`offset`, a window's `_idx`); every other scalar of
# it (quantization, window size, padding) must equal this model's
OFFSETS = {KVCache: (".2",), QuantizedKVCache: (".2",), RotatingKVCache: (".2", ".5")}


class BundleError(ValueError):
    """A bundle this worker will not import, with a named `reason` (the error's code) and its
    HTTP `status` (409: another model's state; else 400)."""

    def __init__(self, message: str, reason: str, status: int = 400) -> None:
        super().__init__(message)
        self.reason, self.status = reason, status


def check_position(pos: Any) -> int:
    if not isinstance(pos, int) or isinstance(pos, bool) or pos <= 0:
        raise BundleError(f"bad position {pos!r}", "bad_position")
    return pos


def check_tokens(tokens: np.ndarray | None, pos: int, vocab: int) -> list[int]:
    """The bundle's `pos` token ids: int32 (as exported), one per position, each an id of
    this model's vocabulary of `vocab` ids."""
    if tokens is None or tokens.shape != (pos,):
        raise BundleError(f"the bundle's tokens do not match its position {pos}", "bad_tokens")
    if tokens.dtype != TOKEN_DTYPE:
        raise BundleError(f"token ids of dtype {tokens.dtype}, not int32", "bad_tokens")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
        raise BundleError(f"a token id outside this model's vocabulary ({vocab} ids)",
                          "token_out_of_vocabulary")
    return [int(t) for t in tokens]


def device_arrays(host: dict[str, np.ndarray], dtypes: Any) -> dict[str, mx.array]:
    """The bundle's tensors as MLX arrays, each of a dtype cache leaves hold and finite."""
    if not isinstance(dtypes, dict) or any(
            v != "bfloat16" or k not in host or host[k].dtype != np.uint16
            for k, v in dtypes.items()):
        raise BundleError("the bundle's dtype table does not match its tensors", "wrong_dtype")
    arrays = {}
    for name, a in host.items():
        if name in dtypes:
            if (np.bitwise_and(a, BF16_EXPONENT) == BF16_EXPONENT).any():
                raise BundleError(f"tensor {name}: values that are not finite", "not_finite")
            arrays[name] = mx.array(a).view(mx.bfloat16)
            continue
        if a.dtype not in HOST_DTYPES:
            raise BundleError(f"tensor {name}: dtype {a.dtype} is in no cache", "wrong_dtype")
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise BundleError(f"tensor {name}: values that are not finite", "not_finite")
        arrays[name] = mx.array(a)
    return arrays


def array_names(skeleton: Any) -> list[str]:
    """The tensor names a leaf's state skeleton refers to (`diskfmt.flatten`), in order."""
    if not isinstance(skeleton, dict):
        return []
    if "a" in skeleton:
        return [str(skeleton["a"])]
    items = skeleton.get("t", skeleton.get("l"))
    return [n for v in items for n in array_names(v)] if isinstance(items, list) else []


def check_uses(used: list[str], tensors: set[str]) -> None:
    """Every tensor is part of exactly one leaf's state: nothing rides along unchecked."""
    if sorted(used) != sorted(tensors):
        raise BundleError("the bundle's tensors are not its leaves' arrays, each once",
                          "wrong_structure")


def check_leaf(i: int, ref: Any, state: Any, pos: int) -> None:
    """`state` has the structure, array dtypes and shapes of the reference leaf's (positions
    aside), and a positional leaf holds at most `pos` positions (exactly `pos` for full KV)."""
    positional = isinstance(ref, POSITIONAL)

    def walk(r: Any, s: Any, path: str) -> None:
        if isinstance(r, mx.array):
            if not isinstance(s, mx.array) or s.dtype != r.dtype:
                raise BundleError(f"leaf {i}{path}: not a {r.dtype} array", "wrong_dtype")
            fixed = [d for k, d in enumerate(r.shape) if not (positional and k == r.ndim - 2)]
            got = [d for k, d in enumerate(s.shape) if not (positional and k == s.ndim - 2)]
            if s.ndim != r.ndim or fixed != got or (positional and s.shape[-2] > pos):
                raise BundleError(f"leaf {i}{path}: shape {s.shape} does not fit this model",
                                  "wrong_shape")
            if isinstance(ref, (KVCache, QuantizedKVCache)) and s.shape[-2] != pos:
                raise BundleError(f"leaf {i}{path}: {s.shape[-2]} positions, not {pos}",
                                  "wrong_shape")
        elif isinstance(r, list | tuple):
            if not isinstance(s, list | tuple) or len(s) != len(r):
                raise BundleError(f"leaf {i}{path}: wrong structure", "wrong_structure")
            for k, (a, b) in enumerate(zip(r, s, strict=True)):
                walk(a, b, f"{path}.{k}")
        elif path in OFFSETS.get(type(ref), ()):
            if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= pos:
                raise BundleError(f"leaf {i}{path}: bad position {s!r}", "bad_position")
        elif type(s) is not type(r) or s != r:    # sizes, quantization, window, padding
            raise BundleError(f"leaf {i}{path}: {s!r}, this model has {r!r}", "wrong_structure")

    walk(ref.state, state, "")


def check_built(i: int, leaf: Any, pos: int) -> None:
    """A leaf built from a checked state is at the bundle's position, and a sliding window's
    write slot lies inside its buffer."""
    if getattr(leaf, "offset", pos) != pos:
        raise BundleError(f"leaf {i}: at position {leaf.offset}, not {pos}", "bad_position")
    if type(leaf) is RotatingKVCache and (leaf.keys is None or leaf._idx > leaf.keys.shape[-2]):
        raise BundleError(f"leaf {i}: window slot {leaf._idx} past its buffer", "bad_position")
