"""vLLM's KV event wire format (`vllm/distributed/kv_events.py`), encoded and decoded.

A message is ZMQ multipart `[topic, sequence, payload]`: the sequence an 8-byte big-endian
integer, one per batch, from 0 without gaps; the payload a msgpack `EventBatch` `{ts, events,
data_parallel_rank}`. Each event is `BlockStored`, `BlockRemoved` or `AllBlocksCleared`.

Two encodings exist. vLLM encodes maps with a `"type"` key since PR #42892 (2026-06; msgspec
structs with `tag=True`, `omit_defaults=True`: a field left at its default is omitted, a
field without one is always there); before it, positional arrays (`array_like=True`: the
batch `[ts, events, rank]`, an event `["BlockStored", hashes, parent, ...]`, every field
written, defaults included; a reader fills in missing trailing defaults and ignores extra
trailing fields). prefixd publishes maps by default (`encoding="array"` for older consumers),
byte for byte what msgspec writes, and decodes both, at both levels, as vLLM's consumers do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

MAP, ARRAY = "map", "array"
ENCODINGS = (MAP, ARRAY)
END_SEQ = (-1).to_bytes(8, "big", signed=True)   # the replay's last frame


class WireError(ValueError):
    """A message that is not a KV event batch."""


@dataclass(frozen=True)
class BlockStored:
    """Blocks now held: `block_hashes` in chain order (each block's parent is the one before
    it; the first's is `parent_block_hash`, None at a prompt's start), `token_ids` the tokens
    of all of them (`block_size` each; prefixd's variable spans put one block per event)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class Batch:
    ts: float
    events: tuple[Event, ...] = field(default_factory=tuple)
    data_parallel_rank: int | None = None


# (field, has a default) in vLLM's declaration order: what an array holds, position by position
_FIELDS: dict[str, tuple[tuple[str, bool], ...]] = {
    "BlockStored": (("block_hashes", False), ("parent_block_hash", False), ("token_ids", False),
                    ("block_size", False), ("lora_id", False), ("medium", False),
                    ("lora_name", False), ("extra_keys", True), ("group_idx", True),
                    ("kv_cache_spec_kind", True), ("kv_cache_spec_sliding_window", True)),
    "BlockRemoved": (("block_hashes", False), ("medium", False), ("group_idx", True)),
    "AllBlocksCleared": (),
}
_CLASSES: dict[str, type] = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
                             "AllBlocksCleared": AllBlocksCleared}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _event_obj(event: Event, encoding: str) -> Any:
    name = type(event).__name__
    values = [(f, getattr(event, f), dflt) for f, dflt in _FIELDS[name]]
    if encoding == MAP:
        out: dict[str, Any] = {"type": name}
        out.update((f, _plain(v)) for f, v, dflt in values if not (dflt and v is None))
        return out
    # every field, as msgspec writes an `array_like` struct (positional readers count on it)
    return [name, *(_plain(v) for _, v, _ in values)]


def encode(batch: Batch, encoding: str = MAP) -> bytes:
    """The msgpack payload of `batch` in `encoding` (`map`, vLLM's default now, or `array`)."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}")
    events = [_event_obj(e, encoding) for e in batch.events]
    if encoding == MAP:
        obj: Any = {"ts": batch.ts, "events": events}
        if batch.data_parallel_rank is not None:
            obj["data_parallel_rank"] = batch.data_parallel_rank
    else:
        obj = [batch.ts, events, batch.data_parallel_rank]
    return msgpack.packb(obj, use_bin_type=True)


def _hash(value: Any) -> int:
    """A block hash: an int, or bytes (vLLM's raw hashes, with int hashes switched off) read
    as vLLM's `maybe_convert_block_hash` does (the last 8 bytes, big-endian)."""
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise WireError(f"a block hash must be an int or bytes, not {type(value).__name__}")
    return int.from_bytes(value[-8:], "big") if isinstance(value, bytes) else value


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{what} must be an int, not {type(value).__name__}")
    return value


def _optional(value: Any, kind: type, what: str) -> Any:
    """`value` if it is None or a `kind` (msgspec's check of an `X | None` field)."""
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise WireError(f"{what} must be {kind.__name__} or nil, not {type(value).__name__}")


def _hashes(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise WireError(f"{what} must be an array, not {type(value).__name__}")
    return tuple(_hash(h) for h in value)


def _extra_keys(value: Any) -> tuple[Any, ...] | None:
    """vLLM's `list[tuple[Any, ...] | None] | None`: per block, a tuple (an array on the wire)
    or nil."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(k is None or isinstance(k, list) for k in value):
        raise WireError("extra_keys must be an array of arrays or nils")
    return tuple(None if k is None else tuple(k) for k in value)


def _decode_event(obj: Any) -> Event | None:
    """One event; None for a type this reader does not know (a newer producer's)."""
    if isinstance(obj, dict):
        name = obj.get("type")
        if not isinstance(name, str):
            raise WireError("an event map needs its 'type'")
        fields = _FIELDS.get(name)
        if fields is None:
            return None
        values = dict(obj)
    elif isinstance(obj, list) and obj and isinstance(obj[0], str):
        name = obj[0]
        fields = _FIELDS.get(name)
        if fields is None:
            return None
        # extra trailing fields (a newer producer's) are ignored, as msgspec's decoder does
        values = {f: v for (f, _), v in zip(fields, obj[1:], strict=False)}
    else:
        raise WireError("an event is a map with 'type' or an array starting with its name")
    missing = [f for f, dflt in fields if not dflt and f not in values]
    if missing:
        raise WireError(f"{name}: missing {', '.join(missing)}")
    kw = {f: values.get(f) for f, _ in fields}
    if name == "BlockStored":
        kw["block_hashes"] = _hashes(kw["block_hashes"], "block_hashes")
        parent = kw["parent_block_hash"]
        kw["parent_block_hash"] = None if parent is None else _hash(parent)
        tokens = kw["token_ids"]
        if not isinstance(tokens, list):
            raise WireError(f"token_ids must be an array, not {type(tokens).__name__}")
        kw["token_ids"] = tuple(_int(t, "a token id") for t in tokens)
        kw["block_size"] = _int(kw["block_size"], "block_size")
        kw["lora_id"] = _optional(kw["lora_id"], int, "lora_id")
        kw["lora_name"] = _optional(kw["lora_name"], str, "lora_name")
        kw["extra_keys"] = _extra_keys(kw["extra_keys"])
        kw["kv_cache_spec_kind"] = _optional(kw["kv_cache_spec_kind"], str,
                                             "kv_cache_spec_kind")
        kw["kv_cache_spec_sliding_window"] = _optional(kw["kv_cache_spec_sliding_window"], int,
                                                       "kv_cache_spec_sliding_window")
    elif name == "BlockRemoved":
        kw["block_hashes"] = _hashes(kw["block_hashes"], "block_hashes")
    if name != "AllBlocksCleared":
        kw["medium"] = _optional(kw["medium"], str, "medium")
        kw["group_idx"] = _optional(kw["group_idx"], int, "group_idx")
    return _CLASSES[name](**kw)


def decode(payload: bytes) -> Batch:
    """A batch in either encoding (events of unknown types are skipped); WireError if it is
    none."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:      # ValueError and its kin; TypeError for an array as a map key
        raise WireError(f"not msgpack: {e}") from None
    if isinstance(obj, dict):
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, list) and len(obj) >= 2:     # extra trailing fields ignored
        ts, events, rank = obj[0], obj[1], obj[2] if len(obj) > 2 else None
    else:
        raise WireError("a batch is a map {ts, events} or an array [ts, events, rank]")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not isinstance(events, list):
        raise WireError("a batch needs a numeric 'ts' and a list of 'events'")
    rank = _optional(rank, int, "data_parallel_rank")
    out = tuple(e for e in map(_decode_event, events) if e is not None)
    return Batch(float(ts), out, rank)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError("a sequence number is 8 bytes")
    return int.from_bytes(frame, "big", signed=True)
