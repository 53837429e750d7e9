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

An import is untrusted input, checked before anything is stored (`engine/transfer/check.py`): the
worker first verifies the bundle's MAC over the bytes it received (`server/seal.py`, in
`server/cacheio.py`); then its checksum, its key (model fingerprint, file format, cache layout, KV
quantization) must be this model's, its token ids int32 and in the vocabulary, its tensors finite,
of the dtypes the cache holds and each used once, and every leaf this model's cache class with its
structure, array dtypes and shapes (measured on a one-token pass) at exactly `pos` positions. A
bundle that fails is refused (`BundleError` with a named reason: 400, or 409 for another model), and
nothing of it is stored, in RAM or on disk.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import safetensors.numpy

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.disk import fmt as diskfmt
from prefixd.backends.mlx.engine.stats import PromptStats
from prefixd.backends.mlx.engine.tierglue import layout
from prefixd.backends.mlx.engine.transfer import check
from prefixd.backends.mlx.engine.transfer.check import BundleError

if TYPE_CHECKING:
    from prefixd.backends.mlx.engine.engine import Engine

KIND = "prefixd-state"
TOKENS = "tokens"
FIELDS = {"kind", "key", "pos", "leaves", "dtypes", "digest"}     # a description has exactly these
__all__ = ["BundleError", "bundle_key", "export", "import_"]


def bundle_key(engine: Engine) -> str:
    """What must match for a state to be valid here: the model's files, the file format, the
    cache layout and the KV quantization."""
    blob = json.dumps([engine.model_id, diskfmt.FORMAT, layout(engine.fresh_cache()),
                       engine.config.kv_bits])
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


# --- export --------------------------------------------------------------------------------
def export(engine: Engine, tokens: Sequence[int],
           namespace: str = "") -> tuple[bytes, int] | None:
    """(bundle, pos) of the longest prefix of `tokens` (at most all but the last) this worker
    restores now for a request of `namespace`, from RAM or disk; None when it holds none."""
    cache, pos = engine.restore_only(list(tokens), PromptStats(len(tokens)), namespace)
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
def parse(data: bytes, key: str, vocab: int) -> tuple[dict[str, Any], dict[str, mx.array],
                                                      list[int]]:
    """(description, arrays, tokens) of a bundle for the model with bundle key `key` and a
    vocabulary of `vocab` ids; `BundleError` for anything else (`engine/transfer/check.py`)."""
    try:
        meta = _meta(data)
        host = safetensors.numpy.load(data)
    except BundleError:
        raise
    except Exception as e:
        raise BundleError(f"not a prefixd state bundle: {type(e).__name__}: {e}",
                          "not_a_bundle") from None
    if not isinstance(meta, dict) or meta.get("kind") != KIND or set(meta) != FIELDS:
        raise BundleError("not a prefixd state bundle", "not_a_bundle")
    if meta.get("digest") != _digest(host):
        raise BundleError("the bundle's data does not match its checksum", "damaged")
    if meta.get("key") != key:
        raise BundleError("this bundle holds another model's state (its model, cache layout or "
                          "KV quantization differ)", "other_model", status=409)
    pos = check.check_position(meta.get("pos"))
    tokens = check.check_tokens(host.pop(TOKENS, None), pos, vocab)
    return meta, check.device_arrays(host, meta["dtypes"]), tokens


def _meta(data: bytes) -> Any:
    n = int.from_bytes(data[:8], "little")
    if not 0 < n <= len(data) - 8:
        raise BundleError("not a safetensors file", "not_a_bundle")
    header = json.loads(data[8:8 + n])
    return json.loads(header["__metadata__"][diskfmt.META])


def rebuild(engine: Engine, meta: dict[str, Any], arrays: dict[str, mx.array]) -> list[Any]:
    """The live cache a bundle describes, checked leaf by leaf against this model's."""
    pos = meta["pos"]
    reference = engine.reference_leaves()
    described = meta.get("leaves")
    if not isinstance(described, dict) or len(described) != len(reference):
        raise BundleError(f"the bundle does not describe this model's {len(reference)} cache "
                          "leaves", "wrong_structure")
    leaves, used = [], []
    for i, ref in enumerate(reference):
        d = described.get(str(i))
        if not isinstance(d, dict) or d.get("class") != type(ref).__name__:
            raise BundleError(f"leaf {i}: not a {type(ref).__name__}", "wrong_structure")
        try:
            state = diskfmt.unflatten(d["state"], arrays)
            used += check.array_names(d["state"])
        except Exception:       # a skeleton of another shape, a name of no tensor, too deep
            raise BundleError(f"leaf {i}: its state does not match its arrays",
                              "wrong_structure") from None
        check.check_leaf(i, ref, state, pos)
        leaf = type(ref).from_state(state)
        check.check_built(i, leaf, pos)
        leaves.append(leaf)
    check.check_uses(used, set(arrays))
    try:
        cache = snapshot.restore(snapshot.rebuild(engine.fresh_cache(), leaves), None, pos)
    except snapshot.RestoreError as e:
        raise BundleError(str(e), "bad_position") from None
    snapshot.evaluate(cache)
    return cache


def import_(engine: Engine, data: bytes, vocab: int, namespace: str = "") -> int:
    """Store a bundle's state as an entry of this worker's checkpoint store (in `namespace`'s
    partition); its position. `vocab`: the model's vocabulary size (its tokenizer's, as
    requests are checked against)."""
    meta, arrays, tokens = parse(data, bundle_key(engine), vocab)
    cache = rebuild(engine, meta, arrays)
    return engine.adopt(tokens, cache, namespace)
