"""Moving a prompt prefix's cache state from one worker to another (generation thread side).

Owns: the bundle, one self-describing safetensors file holding the state of a model at one
position (every leaf whole: the full-attention KV of exactly `pos` positions, sliding windows,
recurrent state) and its `pos` token ids; exporting the longest prefix of a prompt this worker
can restore (RAM or disk, the same restore a request does), and importing a bundle from another
worker of the same model into the checkpoint store, where the next request finds it as if this
worker had computed it.

The proxy moves bundles (`proxy/stages/transfer.py`): when a request goes to a worker that
lacks a long prefix another worker of the same model holds or is computing, it asks that worker
to export the prefix and this one to import it, instead of recomputing it. The state is the
exporting worker's own, so a request restored from it gives what that worker's restore would.

An import is checked before anything is stored: the bundle's key (model fingerprint, file
format, cache layout, KV quantization) must be this model's, and every leaf must have this
model's cache class and array shapes and dtypes (measured on a one-token pass), with exactly
`pos` positions. A bundle that fails is refused (`BundleError`: 400, or 409 for another model),
never stored.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np
import safetensors.numpy
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from prefixd.backends.mlx import diskfmt, snapshot
from prefixd.backends.mlx.disktier import layout
from prefixd.backends.mlx.stats import PromptStats

if TYPE_CHECKING:
    from prefixd.backends.mlx.engine import Engine

KIND = "prefixd-state"
TOKENS = "tokens"
POSITIONAL = (KVCache, QuantizedKVCache, RotatingKVCache)   # axis -2 counts positions
# where a leaf's `state` holds positions (`offset`, a window's `_idx`); every other scalar of
# it (quantization, window size, padding) must equal this model's
OFFSETS = {KVCache: (".2",), QuantizedKVCache: (".2",), RotatingKVCache: (".2", ".5")}


class BundleError(ValueError):
    """A bundle this worker will not import; `status` 409: another model's state."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def bundle_key(engine: Engine) -> str:
    """What must match for a state to be valid here: the model's files, the file format, the
    cache layout and the KV quantization."""
    blob = json.dumps([engine.model_id, diskfmt.FORMAT, layout(engine.fresh_cache()),
                       engine.config.kv_bits])
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


# --- export --------------------------------------------------------------------------------
def export(engine: Engine, tokens: Sequence[int]) -> tuple[bytes, int] | None:
    """(bundle, pos) of the longest prefix of `tokens` (at most all but the last) this worker
    restores now, from RAM or disk; None when it holds none."""
    cache, pos = engine.restore_only(list(tokens), PromptStats(len(tokens)))
    if pos <= 0:
        return None
    tensors: diskfmt.Host = {}
    dtypes: dict[str, str] = {}
    desc = {}
    for i, leaf in enumerate(snapshot.leaves(cache)):
        snapshot.compact(leaf, pos)
        desc[str(i)] = {"class": type(leaf).__name__,
                        "state": diskfmt.flatten(leaf.state, f"s{i}", tensors, dtypes)}
    tensors[TOKENS] = np.asarray(tokens[:pos], dtype=np.int32)
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    meta = {"kind": KIND, "key": bundle_key(engine), "pos": pos, "leaves": desc,
            "dtypes": dtypes, "digest": _digest(tensors)}
    data = safetensors.numpy.save(tensors, metadata={diskfmt.META: json.dumps(meta)})
    return data, pos


def _digest(tensors: dict[str, np.ndarray]) -> str:
    """A checksum of every tensor's name, dtype, shape and bytes: a bundle damaged on its way
    (or by a bug) is refused, never restored."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        a = tensors[name]
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).data.cast("B"))
    return h.hexdigest()


# --- import --------------------------------------------------------------------------------
def parse(data: bytes, key: str) -> tuple[dict[str, Any], dict[str, mx.array], list[int]]:
    """(description, arrays, tokens) of a bundle for the model with bundle key `key`."""
    try:
        meta = _meta(data)
        host = safetensors.numpy.load(data)
    except BundleError:
        raise
    except Exception as e:
        raise BundleError(f"not a prefixd state bundle: {type(e).__name__}: {e}") from None
    if not isinstance(meta, dict) or meta.get("kind") != KIND:
        raise BundleError("not a prefixd state bundle")
    if meta.get("digest") != _digest(host):
        raise BundleError("the bundle's data does not match its checksum")
    arrays = {name: mx.array(a) for name, a in host.items()}
    if meta.get("key") != key:
        raise BundleError("this bundle holds another model's state (its model, cache layout or "
                          "KV quantization differ)", status=409)
    pos = meta.get("pos")
    tokens = arrays.pop(TOKENS, None)
    if not isinstance(pos, int) or pos <= 0 or tokens is None or tokens.shape != (pos,):
        raise BundleError("the bundle's tokens do not match its position")
    for name, dt in (meta.get("dtypes") or {}).items():
        if dt == "bfloat16" and name in arrays:
            arrays[name] = arrays[name].view(mx.bfloat16)
    return meta, arrays, cast(list[int], tokens.tolist())  # 1-D: a list (mlx's stub: any form)


def _meta(data: bytes) -> Any:
    n = int.from_bytes(data[:8], "little")
    if not 0 < n <= len(data) - 8:
        raise BundleError("not a safetensors file")
    header = json.loads(data[8:8 + n])
    return json.loads(header["__metadata__"][diskfmt.META])


def rebuild(engine: Engine, meta: dict[str, Any], arrays: dict[str, mx.array]) -> list[Any]:
    """The live cache a bundle describes, checked leaf by leaf against this model's."""
    pos = meta["pos"]
    reference = engine.reference_leaves()
    described = meta.get("leaves")
    if not isinstance(described, dict) or len(described) != len(reference):
        raise BundleError(f"the bundle has {len(described or {})} cache leaves; this model "
                          f"has {len(reference)}")
    leaves = []
    for i, ref in enumerate(reference):
        d = described.get(str(i))
        if not isinstance(d, dict) or d.get("class") != type(ref).__name__:
            raise BundleError(f"leaf {i}: not a {type(ref).__name__}")
        try:
            state = diskfmt.unflatten(d["state"], arrays)
        except Exception:
            raise BundleError(f"leaf {i}: its state does not match its arrays") from None
        _check(i, ref, state, pos)
        leaf = type(ref).from_state(state)
        if getattr(leaf, "offset", pos) != pos:
            raise BundleError(f"leaf {i}: at position {leaf.offset}, not {pos}")
        leaves.append(leaf)
    try:
        cache = snapshot.restore(snapshot.rebuild(engine.fresh_cache(), leaves), None, pos)
    except snapshot.RestoreError as e:
        raise BundleError(str(e)) from None
    snapshot.evaluate(cache)
    return cache


def _check(i: int, ref: Any, state: Any, pos: int) -> None:
    """`state` has the structure, array dtypes and shapes of the reference leaf's (positions
    aside), and a positional leaf holds at most `pos` positions (exactly `pos` for full KV)."""
    positional = isinstance(ref, POSITIONAL)

    def walk(r: Any, s: Any, path: str) -> None:
        if isinstance(r, mx.array):
            if not isinstance(s, mx.array) or s.dtype != r.dtype or s.ndim != r.ndim:
                raise BundleError(f"leaf {i}{path}: wrong array type or rank")
            fixed = [d for k, d in enumerate(r.shape) if not (positional and k == r.ndim - 2)]
            got = [d for k, d in enumerate(s.shape) if not (positional and k == s.ndim - 2)]
            if fixed != got or (positional and s.shape[-2] > pos):
                raise BundleError(f"leaf {i}{path}: shape {s.shape} does not fit this model")
            if isinstance(ref, (KVCache, QuantizedKVCache)) and s.shape[-2] != pos:
                raise BundleError(f"leaf {i}{path}: {s.shape[-2]} positions, not {pos}")
        elif isinstance(r, list | tuple):
            if not isinstance(s, list | tuple) or len(s) != len(r):
                raise BundleError(f"leaf {i}{path}: wrong structure")
            for k, (a, b) in enumerate(zip(r, s, strict=True)):
                walk(a, b, f"{path}.{k}")
        elif path in OFFSETS.get(type(ref), ()):
            if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= pos:
                raise BundleError(f"leaf {i}{path}: bad position {s!r}")
        elif type(s) is not type(r) or s != r:    # sizes, quantization, window, padding
            raise BundleError(f"leaf {i}{path}: {s!r}, this model has {r!r}")

    walk(ref.state, state, "")


def import_(engine: Engine, data: bytes) -> int:
    """Store a bundle's state as an entry of this worker's checkpoint store; its position."""
    meta, arrays, tokens = parse(data, bundle_key(engine))
    cache = rebuild(engine, meta, arrays)
    return engine.adopt(tokens, cache)
