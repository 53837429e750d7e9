"""How the disk tier lays cache state out in files (safetensors + a JSON description).

Owns: the file format (`FORMAT`), turning live cache leaves into host arrays (on the generation
thread: numpy views of evaluated MLX arrays, zero-copy; bfloat16 travels as its uint16 bits),
writing a file so that a crash never leaves one that loads (temp name, fsync, rename; a failed
write leaves no temp file), reading a file's description without its data, loading a file only
if it matches its checksums, and rebuilding cache leaves from loaded arrays.

Checksums (format 2): the description carries a CRC-32 of every tensor (over its dtype, shape
and bytes, computed on the writer thread), and the description itself has a CRC-32 under
metadata key `prefixd_crc`. A file whose description does not match is refused when it is
indexed, a tensor that does not match when it is loaded (`Corrupt`): flipped bits, a bad
sector or a half-synced file never become a cache state. Files are the daemon user's only
(0600 in 0700 directories): their token tensors decode to prompts and answers.

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

import functools
import json
import os
import zlib
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import safetensors
import safetensors.numpy
from mlx_lm.models.cache import QuantizedKVCache

from prefixd.backends.mlx.cache.snapshot import KINDS
from prefixd.backends.mlx.disk.fs import FILE_MODE, kind

FORMAT = 2                   # 2: checksums (files without them are never loaded)
META = "prefixd"
META_CRC = "prefixd_crc"     # CRC-32 of the description string under META
SUFFIX = ".safetensors"
CLASSES = {cls.__name__: cls for cls in KINDS}

Host = dict[str, np.ndarray]   # tensor name -> host array


class FormatError(ValueError):
    """A file that is not a prefixd cache file of this model and format."""


class Corrupt(FormatError):
    """A file of this format whose description or data do not match their checksums."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path.name}: {why}")
        self.path = path


def checksum(a: Any) -> int:
    """CRC-32 of an array's dtype, shape and bytes: a numpy array, or an evaluated MLX array
    (through the buffer protocol: no copy; never bfloat16, which travels as uint16)."""
    view = memoryview(a)
    if not view.c_contiguous:
        view = np.ascontiguousarray(np.asarray(view)).data
    return zlib.crc32(view, zlib.crc32(f"{_dtype_name(view.format)}{view.shape}".encode()))


@functools.cache
def _dtype_name(fmt: str) -> str:
    """numpy's name of a buffer format ('f', '<f', 'H', ...): the same for numpy and MLX."""
    return np.dtype(fmt).name


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
    """Write a file atomically and durably, with the checksums of its tensors and of its
    description; its size in bytes. On any error the temp file is gone and `path` untouched."""
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    text = json.dumps({**desc, "sums": {k: checksum(v) for k, v in arrays.items()}},
                      separators=(",", ":"))
    data = safetensors.numpy.save(arrays, metadata={META: text,
                                                    META_CRC: str(zlib.crc32(text.encode()))})
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE),
                       "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(data)


def sync_dir(path: Path) -> None:
    """Make the renames in `path` durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
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
    truncated or has no description, Corrupt if it is of this format and its description
    does not match its checksum. The caller closes the handle (a context manager)."""
    try:
        f = safetensors.safe_open(str(path), framework="numpy")
    except Exception as e:  # SafetensorError, OSError: truncated, foreign, unreadable
        raise FormatError(f"unreadable ({e})") from e
    try:
        desc = _description(path, f.metadata() or {})
    except Exception:
        f.__exit__(None, None, None)
        raise
    return desc, f


def _description(path: Path, meta: dict[str, str]) -> dict[str, Any]:
    """The description in a file's metadata, checked against its CRC when it claims to be
    of this format (an older or newer file is the caller's to refuse by its `format`)."""
    try:
        desc = json.loads(meta[META])
        if not isinstance(desc, dict):
            raise ValueError("not an object")
    except Exception as e:
        raise FormatError("no prefixd description") from e
    if desc.get("format") == FORMAT and (
            meta.get(META_CRC) != str(zlib.crc32(meta[META].encode())) or
            not isinstance(desc.get("sums"), dict)):
        raise Corrupt(path, "description checksum mismatch")
    return desc


def verify(path: Path, desc: dict[str, Any], name: str, a: Any) -> None:
    """Corrupt unless tensor `name` of the file matches its checksum."""
    if desc["sums"].get(name) != checksum(a):
        raise Corrupt(path, f"tensor {name} checksum mismatch")


# --- generation thread: arrays -> live leaves -------------------------------------------------
Loaded = tuple[dict[str, mx.array], dict[str, Any]]     # (arrays, description)


def load(paths: list[Path]) -> list[Loaded]:
    """(arrays, description) of each file, all read in one evaluation, each file of this
    format with a description and every tensor matching their checksums (bfloat16 tensors
    viewed back). Corrupt (naming the file) if any does not, or a file has tensors its
    description does not list or lacks one it lists; nothing is returned unless every file
    checks. The token ids are left out (never read): they were checked when the file was
    indexed (their checksum and the chain of ids), and the index holds them."""
    opened = [_open(p) for p in paths]
    try:
        mx.eval([list(arrays.values()) for arrays, _ in opened])
    except Exception:                  # which file: read them one by one
        for p, (arrays, _) in zip(paths, opened, strict=True):
            try:
                mx.eval(list(arrays.values()))
            except Exception as e:
                raise Corrupt(p, f"unreadable ({e})") from e
        raise
    out = []
    for p, (arrays, desc) in zip(paths, opened, strict=True):
        for name, a in arrays.items():
            verify(p, desc, name, a)
        dtypes = desc.get("dtypes", {})
        out.append(({k: (v.view(mx.bfloat16) if dtypes.get(k) == "bfloat16" else v)
                     for k, v in arrays.items()}, desc))
    return out


def _open(path: Path) -> Loaded:
    """A file's arrays but its token ids (not read yet) and its checked description."""
    if kind(path) != "file":        # replaced by a link (or anything else) since indexed
        raise Corrupt(path, "not a regular file")
    try:
        # with return_metadata: (arrays, metadata); mlx's stub gives every form `load` returns
        arrays, meta = cast(tuple[dict[str, mx.array], dict[str, str]],
                            mx.load(str(path), return_metadata=True))
    except Exception as e:          # truncated, unreadable
        raise Corrupt(path, f"unreadable ({e})") from e
    desc = _description(path, meta)
    if desc.get("format") != FORMAT:
        raise FormatError(f"{path.name}: format {desc.get('format')}")
    if set(desc["sums"]) != set(arrays):
        raise Corrupt(path, "tensors differ from the description")
    arrays.pop("tokens", None)
    return arrays, desc


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
