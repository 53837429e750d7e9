"""How the disk tier lays cache state out in files (safetensors + a JSON description).

Owns: the file format (`FORMAT`), turning live cache leaves into host arrays (on the generation
thread: numpy views of evaluated MLX arrays, zero-copy; bfloat16 travels as its uint16 bits),
writing a file so that a crash never leaves one that loads (temp name, fsync, rename), reading
a file's description without its data, and rebuilding cache leaves from loaded arrays.

Two kinds of files, both `<id>.safetensors` with the description under metadata key `prefixd`:
- a block: the full-attention KV (`KVCache`, `QuantizedKVCache` leaves) of positions
  `[j*B, (j+1)*B)` and their token ids; content-addressed (`chain.block_ids`), shared by every
  record whose prefix contains it, written once;
- a record: the state at one position `pos`: the ids of the blocks holding its prefix (the last
  one possibly used in part: the load trims it), the tail KV past its last block and its tokens
  (only a state in its entry's last, unfinished block has one), and every other leaf (sliding
  windows, recurrent state) whole,
  described by a skeleton of its `state` tuple so any verified cache class round-trips.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import safetensors
import safetensors.numpy
from mlx_lm.models.cache import QuantizedKVCache

from prefixd.backends.mlx.snapshot import KINDS

FORMAT = 1
META = "prefixd"
SUFFIX = ".safetensors"
CLASSES = {cls.__name__: cls for cls in KINDS}

Host = dict[str, np.ndarray]   # tensor name -> host array


class FormatError(ValueError):
    """A file that is not a prefixd cache file of this model and format."""


# --- generation thread: live leaves -> host arrays ------------------------------------------
def host(a: mx.array, name: str, out: Host, dtypes: dict[str, str]) -> None:
    """Put a numpy view of the evaluated array `a` in `out[name]` (bfloat16 as uint16 bits)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
        mx.eval(a)
        dtypes[name] = "bfloat16"
    out[name] = np.asarray(a)


def kv_arrays(leaf: Any) -> list[mx.array]:
    """The position-indexed buffers of a full-attention leaf: keys then values (a quantized
    leaf's are triples), each `[batch, heads, capacity, dim]`."""
    k, v = leaf.keys, leaf.values
    return [*k, *v] if isinstance(k, tuple) else [k, v]


def kv_desc(leaf: Any) -> dict[str, Any]:
    quant = [leaf.group_size, leaf.bits] if type(leaf) is QuantizedKVCache else None
    return {"class": type(leaf).__name__, "n": len(kv_arrays(leaf)), "quant": quant}


def flatten(x: Any, name: str, out: Host, dtypes: dict[str, str]) -> Any:
    """A JSON skeleton of a leaf's `state`; its arrays go to `out` under `name.path`."""
    if isinstance(x, mx.array):
        host(x, name, out, dtypes)
        return {"a": name}
    if isinstance(x, list | tuple):
        return {"t" if isinstance(x, tuple) else "l":
                [flatten(v, f"{name}.{i}", out, dtypes) for i, v in enumerate(x)]}
    if x is None or isinstance(x, bool | int | float | str):
        return {"v": x}
    raise FormatError(f"cannot store a {type(x).__name__} in a cache state")


# --- writer thread: files ---------------------------------------------------------------------
def write(path: Path, tensors: Host, desc: dict[str, Any]) -> int:
    """Write a file atomically and durably; its size in bytes."""
    data = safetensors.numpy.save({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                                  metadata={META: json.dumps(desc, separators=(",", ":"))})
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(data)


def sync_dir(path: Path) -> None:
    """Make the renames in `path` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def describe(path: Path) -> tuple[dict[str, Any], Any]:
    """(description, open handle) of a cache file; FormatError if it is not one, is
    truncated or has no description. The caller closes the handle (a context manager)."""
    try:
        f = safetensors.safe_open(str(path), framework="numpy")
    except Exception as e:  # SafetensorError, OSError: truncated, foreign, unreadable
        raise FormatError(f"unreadable ({e})") from e
    try:
        desc = json.loads((f.metadata() or {})[META])
        if not isinstance(desc, dict):
            raise ValueError("not an object")
    except Exception as e:
        raise FormatError("no prefixd description") from e
    return desc, f


# --- generation thread: arrays -> live leaves -------------------------------------------------
def load(path: Path, dtypes: dict[str, str]) -> dict[str, mx.array]:
    arrays = mx.load(str(path))
    assert isinstance(arrays, dict)
    for name, dt in dtypes.items():
        if name in arrays and dt == "bfloat16":
            arrays[name] = arrays[name].view(mx.bfloat16)
    return arrays


def unflatten(skel: Any, arrays: dict[str, mx.array]) -> Any:
    if "a" in skel:
        return arrays[skel["a"]]
    if "t" in skel:
        return tuple(unflatten(v, arrays) for v in skel["t"])
    if "l" in skel:
        return [unflatten(v, arrays) for v in skel["l"]]
    return skel["v"]


def state_leaf(desc: dict[str, Any], arrays: dict[str, mx.array]) -> Any:
    cls = CLASSES.get(desc["class"])
    if cls is None:
        raise FormatError(f"unknown cache class {desc['class']}")
    return cls.from_state(unflatten(desc["state"], arrays))


def kv_leaf(desc: dict[str, Any], parts: list[list[mx.array]], pos: int) -> Any:
    """A full-attention leaf holding exactly `pos` positions, from its buffers' pieces in
    position order (`parts[i]`: the pieces of buffer i)."""
    bufs = [mx.concatenate(p, axis=-2) if len(p) > 1 else p[0] for p in parts]
    bufs = [b[..., :pos, :] if b.shape[-2] > pos else b for b in bufs]  # a block used in part
    cls = CLASSES[desc["class"]]
    if desc["quant"]:
        half = len(bufs) // 2
        group, bits = desc["quant"]
        return cls.from_state((tuple(bufs[:half]), tuple(bufs[half:]), pos, group, bits))
    return cls.from_state((bufs[0], bufs[1], pos))
