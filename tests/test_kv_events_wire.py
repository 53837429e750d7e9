"""kvevents/wire.py against vLLM's own definitions: msgspec structs declared here exactly as
vLLM's `vllm/distributed/kv_events.py` declares them, once in the map encoding (vLLM now) and
once with `array_like=True` (older vLLM). What msgspec encodes from them, prefixd decodes to the
same events; what prefixd encodes, msgspec decodes into them; anything else is a WireError."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixd.kvevents import wire

# vLLM's ExternalBlockHash: bytes, or an int once converted (maybe_convert_block_hash)
BlockHash = bytes | int


# ---- the map encoding: vLLM as of 2026 (PR #42892) ----

class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# ---- the array encoding: older vLLM (array_like=True at both levels) ----

class ArrayEventBatch(msgspec.Struct, omit_defaults=True, gc=False, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrayKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True,
                        array_like=True):
    pass


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(ArrayEventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


MIRRORS = {
    wire.MAP: (KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared),
    wire.ARRAY: (ArrayKVEventBatch, ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared),
}
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                 "kv_cache_spec_sliding_window")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def as_int(h: BlockHash) -> int:
    """vLLM's maybe_convert_block_hash, written out: the last 8 bytes, big-endian."""
    if isinstance(h, int):
        return h
    return sum(b << (8 * i) for i, b in enumerate(reversed(h[-8:])))


def expected(event: Any) -> wire.Event:
    """The event prefixd must read from a msgspec event, built field by field."""
    name = type(event).__name__.removeprefix("Array")
    if name == "BlockStored":
        return wire.BlockStored(
            block_hashes=tuple(as_int(h) for h in event.block_hashes),
            parent_block_hash=(None if event.parent_block_hash is None
                               else as_int(event.parent_block_hash)),
            token_ids=tuple(event.token_ids), block_size=event.block_size,
            lora_id=event.lora_id, medium=event.medium, lora_name=event.lora_name,
            extra_keys=None if event.extra_keys is None else tuple(event.extra_keys),
            group_idx=event.group_idx, kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window)
    if name == "BlockRemoved":
        return wire.BlockRemoved(tuple(as_int(h) for h in event.block_hashes), event.medium,
                                 event.group_idx)
    assert name == "AllBlocksCleared"
    return wire.AllBlocksCleared()


def vllm_events(encoding: str) -> list[Any]:
    _, stored, removed, cleared = MIRRORS[encoding]
    return [
        # a prompt's start, every optional left at None (the defaults are omitted on the wire)
        stored([1, 2], None, [5, 6, 7, 8], 2, None, None, None),
        # every optional set
        stored([2**64 - 1], 2, [9, 9, 9], 3, 7, "CPU", "adapter",
               extra_keys=[("mm-hash", 3), None], group_idx=1, kv_cache_spec_kind="mamba",
               kv_cache_spec_sliding_window=4096),
        # only a later default set: the ones before it omitted in a map, nil in an array
        stored([-(2**63)], 1, [1], 1, None, "GPU", None, group_idx=0),
        # raw bytes hashes (vLLM with int hashes switched off): read as their last 8 bytes
        stored([b"\x01" * 32, b"\x00\x00\x00\x00\x00\x00\x01\x02", b"\xff"], b"\xab" * 32,
               [3, 4, 5], 1, None, "GPU", None),
        removed([1, 2**63], "GPU"),
        removed([b"\x07" * 16], None, group_idx=2),
        cleared(),
    ]


@pytest.mark.parametrize("encoding", wire.ENCODINGS)
@pytest.mark.parametrize("rank", [None, 3])
def test_vllm_payloads_decode(encoding: str, rank: int | None) -> None:
    batch_type = MIRRORS[encoding][0]
    events = vllm_events(encoding)
    payload = msgspec.msgpack.encode(batch_type(ts=1234.5, events=events,
                                                data_parallel_rank=rank))
    got = wire.decode(payload)
    assert got == wire.Batch(1234.5, tuple(expected(e) for e in events), rank)
    # the fixture covers what it says it does
    stored = [e for e in got.events if isinstance(e, wire.BlockStored)]
    assert any(e.parent_block_hash is None for e in stored)
    assert any(all(getattr(e, f) is not None for f in STORED_FIELDS) for e in stored)
    assert got.events[3].block_hashes == (0x0101010101010101, 0x0102, 0xFF)
    assert got.events[3].parent_block_hash == 0xABABABABABABABAB


def test_the_two_encodings_differ_on_the_wire() -> None:
    """The mirrors are what they claim: maps with a "type" key, tagged arrays."""
    m = msgpack.unpackb(msgspec.msgpack.encode(
        KVEventBatch(ts=1.0, events=vllm_events(wire.MAP)[:1])))
    a = msgpack.unpackb(msgspec.msgpack.encode(
        ArrayKVEventBatch(ts=1.0, events=vllm_events(wire.ARRAY)[:1])))
    assert m == {"ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": [1, 2],
                                        "parent_block_hash": None, "token_ids": [5, 6, 7, 8],
                                        "block_size": 2, "lora_id": None, "medium": None,
                                        "lora_name": None}]}
    assert a[0] == 1.0 and a[1][0][:5] == ["BlockStored", [1, 2], None, [5, 6, 7, 8], 2]


def prefixd_batch(rank: int | None = 2) -> wire.Batch:
    return wire.Batch(99.25, (
        wire.BlockStored((11, 12), None, (1, 2, 3, 4), 2, medium="GPU"),
        wire.BlockStored((13,), 12, (5, 6, 7), 3, lora_id=4, medium="DISK", lora_name="l",
                         extra_keys=(("salt",), None), group_idx=2,
                         kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=8),
        wire.BlockStored((2**64 - 1,), -5, (0,), 1, group_idx=1),
        wire.BlockRemoved((11, 13), "GPU"),
        wire.BlockRemoved((2**63,), None, group_idx=0),
        wire.AllBlocksCleared(),
    ), rank)


def field_values(event: Any) -> tuple[str, dict[str, Any]]:
    name = type(event).__name__.removeprefix("Array")
    fields = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(name, ())
    values = {f: getattr(event, f) for f in fields}
    for f in ("block_hashes", "token_ids", "extra_keys"):
        if values.get(f) is not None:
            values[f] = tuple(values[f])
    return name, values


@pytest.mark.parametrize("encoding", wire.ENCODINGS)
@pytest.mark.parametrize("rank", [None, 0, 2])
def test_prefixd_payloads_decode_in_vllm(encoding: str, rank: int | None) -> None:
    batch = prefixd_batch(rank)
    payload = wire.encode(batch, encoding)
    got = msgspec.msgpack.Decoder(MIRRORS[encoding][0]).decode(payload)
    assert got.ts == batch.ts and got.data_parallel_rank == rank
    assert [field_values(e) for e in got.events] == [field_values(e) for e in batch.events]
    # byte for byte what vLLM's msgspec writes for the same batch
    assert payload == msgspec.msgpack.encode(got)
    # and the other encoding's mirror does not read it: the two are really different
    other = wire.ARRAY if encoding == wire.MAP else wire.MAP
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(MIRRORS[other][0]).decode(payload)


def test_array_fields_missing_or_extra_at_the_end() -> None:
    """Arrays from a producer with fewer trailing defaults, or more fields than known: read
    as msgspec reads them."""
    short = msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 2, None, "GPU", None],
                                 ["BlockRemoved", [1], None]]])
    long_ = msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 2, None, "GPU", None,
                                  None, 3, "mamba", None, "a newer field"],
                                 ["BlockRemoved", [1], "GPU", 0, "newer"]], None, "newer"])
    for payload in (short, long_):
        mine = wire.decode(payload)
        theirs = msgspec.msgpack.decode(payload, type=ArrayKVEventBatch)
        assert [field_values(e) for e in mine.events] == [field_values(e) for e in theirs.events]
    assert wire.decode(long_).events[0].group_idx == 3


def test_unknown_event_types_are_skipped() -> None:
    known = {"type": "BlockRemoved", "block_hashes": [4], "medium": "GPU"}
    for payload in (
        msgpack.packb({"ts": 1.0, "events": [{"type": "BlockMoved", "x": 1}, known,
                                             {"type": "SomethingNew"}]}),
        msgpack.packb([1.0, [["BlockMoved", 1, 2], ["BlockRemoved", [4], "GPU"],
                             ["SomethingNew"]]]),
    ):
        assert wire.decode(payload).events == (wire.BlockRemoved((4,), "GPU"),)


def test_unknown_map_keys_are_ignored() -> None:
    payload = msgpack.packb({"ts": 1, "events": [{"type": "AllBlocksCleared", "why": "x"}],
                             "newer": True})
    assert wire.decode(payload) == wire.Batch(1.0, (wire.AllBlocksCleared(),))


def _stored_map(**over: Any) -> dict[str, Any]:
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
             "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
             "lora_name": None}
    event.update(over)
    return {k: v for k, v in event.items() if v is not _DROP}


_DROP = object()


def _batch(*events: Any) -> bytes:
    return msgpack.packb({"ts": 1.0, "events": list(events)})


MALFORMED = {
    "empty": b"",
    "not msgpack": b"\xc1",
    "truncated": msgpack.packb({"ts": 1.0, "events": []})[:-3],
    "trailing bytes": msgpack.packb([1.0, []]) + b"\x01",
    "an array as a map key": b"\x81\x91\x01\x01",
    "a huge array header": b"\xdd\xff\xff\xff\xff",
    "too deep": b"\x91" * 5000 + b"\x01",
    "a number": msgpack.packb(3),
    "a string": msgpack.packb("BlockStored"),
    "a one-element batch": msgpack.packb([1.0]),
    "no ts": msgpack.packb({"events": []}),
    "no events": msgpack.packb({"ts": 1.0}),
    "ts a string": msgpack.packb({"ts": "now", "events": []}),
    "ts a bool": msgpack.packb([True, []]),
    "events a map": msgpack.packb({"ts": 1.0, "events": {"type": "AllBlocksCleared"}}),
    "rank a string": msgpack.packb({"ts": 1.0, "events": [], "data_parallel_rank": "0"}),
    "an event a number": _batch(7),
    "an event an empty array": _batch([]),
    "an event without type": _batch({"block_hashes": [1], "medium": None}),
    "an event type a number": _batch({"type": 3}),
    "an array event without name": msgpack.packb([1.0, [[[1], None, [1], 1]]]),
    "stored missing token_ids": _batch(_stored_map(token_ids=_DROP)),
    "stored missing medium": _batch(_stored_map(medium=_DROP)),
    "stored missing parent": _batch(_stored_map(parent_block_hash=_DROP)),
    "removed missing hashes": _batch({"type": "BlockRemoved", "medium": "GPU"}),
    "array stored too short": msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2]]]]),
    "array removed too short": msgpack.packb([1.0, [["BlockRemoved", [1]]]]),
    "a float hash": _batch(_stored_map(block_hashes=[1.5])),
    "a string hash": _batch(_stored_map(block_hashes=["abc"])),
    "a bool hash": _batch({"type": "BlockRemoved", "block_hashes": [True], "medium": None}),
    "a nil hash": _batch({"type": "BlockRemoved", "block_hashes": [None], "medium": None}),
    "a map hash": _batch(_stored_map(block_hashes=[{"a": 1}])),
    "a float parent": _batch(_stored_map(parent_block_hash=2.0)),
    "hashes a string": _batch(_stored_map(block_hashes="abc")),
    "hashes a map": _batch({"type": "BlockRemoved", "block_hashes": {1: 2}, "medium": None}),
    "hashes an int": _batch(_stored_map(block_hashes=5)),
    "hashes nil": _batch(_stored_map(block_hashes=None)),
    "token ids nil": _batch(_stored_map(token_ids=None)),
    "token ids a string": _batch(_stored_map(token_ids="12")),
    "a string token": _batch(_stored_map(token_ids=["1", "2"])),
    "a float token": _batch(_stored_map(token_ids=[1.0, 2.5])),
    "an infinite token": _batch(_stored_map(token_ids=[math.inf, 1])),
    "block size nil": _batch(_stored_map(block_size=None)),
    "block size infinite": _batch(_stored_map(block_size=math.inf)),
    "block size a string": _batch(_stored_map(block_size="2")),
    "medium a list": _batch(_stored_map(medium=["GPU"])),
    "group an array": _batch(_stored_map(group_idx=[1])),
    "removed group a map": _batch({"type": "BlockRemoved", "block_hashes": [1],
                                   "medium": None, "group_idx": {"a": 1}}),
    "lora id a string": _batch(_stored_map(lora_id="x")),
    "lora name a number": _batch(_stored_map(lora_name=3)),
    "extra keys a string": _batch(_stored_map(extra_keys="abc")),
    "an extra key a number": _batch(_stored_map(extra_keys=[1])),
    "spec kind a number": _batch(_stored_map(kv_cache_spec_kind=1)),
    "window a string": _batch(_stored_map(kv_cache_spec_sliding_window="4k")),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_payloads_are_wire_errors(name: str) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(MALFORMED[name])


def test_malformed_cases_are_ones_vllm_rejects_too() -> None:
    """Every malformed payload that is msgpack at all is one vLLM's own decoder refuses in
    both encodings (so prefixd is not stricter than vLLM)."""
    for payload in MALFORMED.values():
        for batch_type in (KVEventBatch, ArrayKVEventBatch):
            with pytest.raises(msgspec.DecodeError):
                msgspec.msgpack.Decoder(batch_type).decode(payload)


def test_sequence_frames() -> None:
    for seq in (0, 1, 255, 2**40, 2**63 - 1, -1):
        assert wire.seq_of(wire.seq_bytes(seq)) == seq
        assert len(wire.seq_bytes(seq)) == 8
    assert wire.seq_bytes(1) == b"\x00" * 7 + b"\x01"      # big-endian, as vLLM writes it
    assert wire.END_SEQ == b"\xff" * 8
    for bad in (b"", b"\x00" * 7, b"\x00" * 9):
        with pytest.raises(wire.WireError):
            wire.seq_of(bad)


def test_encode_rejects_an_unknown_encoding() -> None:
    with pytest.raises(ValueError):
        wire.encode(prefixd_batch(), "json")


# ---- a round-trip property over both encodings, both directions ----

hashes = st.integers(-(2**63), 2**64 - 1)
small = st.integers(0, 2**31 - 1)
maybe_str = st.none() | st.text(max_size=6)
stored_events = st.builds(
    wire.BlockStored,
    block_hashes=st.lists(hashes, min_size=1, max_size=4).map(tuple),
    parent_block_hash=st.none() | hashes,
    token_ids=st.lists(small, max_size=40).map(tuple),
    block_size=st.integers(1, 64),
    lora_id=st.none() | small, medium=maybe_str, lora_name=maybe_str,
    extra_keys=st.none() | st.lists(
        st.none() | st.tuples(st.text(max_size=4), small), max_size=3).map(tuple),
    group_idx=st.none() | st.integers(0, 8), kv_cache_spec_kind=maybe_str,
    kv_cache_spec_sliding_window=st.none() | small)
removed_events = st.builds(wire.BlockRemoved,
                           block_hashes=st.lists(hashes, max_size=4).map(tuple),
                           medium=maybe_str, group_idx=st.none() | st.integers(0, 8))
events = st.one_of(stored_events, removed_events, st.just(wire.AllBlocksCleared()))
batches = st.builds(wire.Batch, ts=st.floats(allow_nan=False, allow_infinity=False),
                    events=st.lists(events, max_size=5).map(tuple),
                    data_parallel_rank=st.none() | st.integers(0, 64))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches, encoding=st.sampled_from(wire.ENCODINGS))
def test_round_trip(batch: wire.Batch, encoding: str) -> None:
    payload = wire.encode(batch, encoding)
    assert wire.decode(payload) == batch
    theirs = msgspec.msgpack.Decoder(MIRRORS[encoding][0]).decode(payload)
    assert payload == msgspec.msgpack.encode(theirs)
    assert wire.decode(msgspec.msgpack.encode(theirs)) == batch


NAMES = ["type", "ts", "events", "data_parallel_rank", "BlockStored", "BlockRemoved",
         "AllBlocksCleared", *STORED_FIELDS]
leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
          | st.text(max_size=12) | st.binary(max_size=9) | st.sampled_from(NAMES))
msgpack_values = st.recursive(
    leaves, lambda inner: st.lists(inner, max_size=6)
    | st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=3), inner, max_size=8),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(payload=st.binary(max_size=64) | msgpack_values.map(msgpack.packb))
def test_anything_is_a_batch_or_a_wire_error(payload: bytes) -> None:
    try:
        batch = wire.decode(payload)
    except wire.WireError:
        return
    assert isinstance(batch, wire.Batch)
    for e in batch.events:
        assert isinstance(e, wire.BlockStored | wire.BlockRemoved | wire.AllBlocksCleared)
        if not isinstance(e, wire.AllBlocksCleared):
            assert all(isinstance(h, int) for h in e.block_hashes)
            assert e.group_idx is None or isinstance(e.group_idx, int)
            assert e.medium is None or isinstance(e.medium, str)
