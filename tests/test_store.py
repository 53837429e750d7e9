"""The checkpoint store's pure policy: prefix lookup, placement, hand-over, budget and eviction."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixd.backends.mlx.cache.placement import (
    auto_interval,
    common_prefix,
    compute_interval,
    placement,
    placement_marks,
    tail_mark,
)
from prefixd.backends.mlx.cache.store import (
    CheckpointStore,
    Entry,
)


def _no_end(_: Entry) -> None:
    return None


def _put(store: CheckpointStore, tokens: list[int], nbytes: int = 10, trimmable: bool = False,
         checkpoints: dict[int, int] | None = None, trim_below: int = 0) -> Entry:
    """An entry with checkpoints {pos: bytes}; those below `trim_below` are trimmable."""
    entry = store.begin(tokens)
    for pos, size in (checkpoints or {}).items():
        store.add_checkpoint(entry, pos, f"ckpt{pos}", size, trimmable=pos < trim_below)
    store.finish(entry, tokens, "kv", nbytes, trimmable, _no_end)
    return entry


def _accounted(store: CheckpointStore) -> int:
    return sum(e.nbytes + sum(c.nbytes for c in e.checkpoints.values()) for e in store.entries)


def test_common_prefix_across_blocks() -> None:
    a = list(range(1000))
    assert common_prefix(a, a) == 1000
    assert common_prefix(a, a[:700]) == 700
    assert common_prefix(a, [*a[:613], -1, *a[614:]]) == 613
    assert common_prefix(a, []) == 0
    assert common_prefix([5], [6]) == 0


def test_placement_marks_boundaries_tail_end_and_interval() -> None:
    got = placement(100, 0, boundaries=[10, 60], interval=16, tail=4)
    assert got == [10, 26, 42, 58, 60, 76, 92, 96, 100]
    # Positions depend on the prompt, not on the restore point; only later ones are returned.
    assert placement(100, 60, [10, 60], 16, 4) == [76, 92, 96, 100]
    # The tail mark: an exact repeat restores there (one pass of the last few tokens).
    assert tail_mark(100, [10, 60], 4) == 96 and tail_mark(100, [10, 60], 0) == 99
    assert placement(3, 0, [], 16, 4) == [2, 3]
    assert placement(50, 0, [], 16, 0) == [16, 32, 48, 49, 50]


def test_the_last_message_end_is_the_tail_mark() -> None:
    # A boundary close to the end (where the generation prompt starts) serves as the tail mark;
    # no extra mark (and no extra prefill pass) a few tokens away from it.
    assert tail_mark(100, [40, 95], 4) == 95 and tail_mark(100, [40, 71], 4) == 71
    assert placement(100, 0, [40, 95], 64, 4) == [40, 95, 100]
    assert tail_mark(100, [40, 60], 4) == 96  # too far: not the last message's end


def test_marks_just_above_the_restore_point_are_left_out() -> None:
    # The next user message's content starts 3 tokens above the previous reply's end: the
    # restore point stays a checkpoint, a cut 3 tokens later would buy 3 tokens.
    assert placement(200, 100, [103, 150], 64, 4) == [150, 196, 200]
    # ... but the tail mark and the end cost no cut and stay
    assert placement(200, 194, [103, 150], 64, 4) == [196, 200]
    assert placement(200, 100, [103, 150], 64, 4, min_gap=0) == [103, 150, 196, 200]


def test_below_a_sliding_window_only_the_highest_mark_is_taken() -> None:
    full = placement(300, 0, [60, 100, 150], 16, 2)
    trimmed = placement(300, 0, [60, 100, 150], 16, 2, trim_below=128)
    assert trimmed == [max(p for p in full if p < 128)] + [p for p in full if p >= 128]
    assert placement(100, 0, [60], 16, 2, trim_below=128) == [100]  # the end serves all


def test_compute_interval_keeps_extra_passes_under_two_percent() -> None:
    # a pass costs 4 ms of overhead, a token 0.7 ms: 64 tokens (45 ms) would pay 9% per cut
    assert compute_interval(0.004, 0.0007) == 512  # 4 ms <= 2% of 512 * 0.7 ms = 7.2 ms
    assert compute_interval(0.004, 0.01) == 64
    assert compute_interval(1.0, 1e-6) == 4096


def test_auto_interval_fits_a_long_conversation_in_a_quarter_of_the_budget() -> None:
    gib, mib = 1024**3, 1024**2
    assert auto_interval(60_000, 4 * gib) == 64  # tiny hybrid: 512 checkpoints = 30 MB
    assert auto_interval(0, 4 * gib) == 64  # nothing to snapshot
    # Qwen3-Next-80B-like (~150 MB per checkpoint): 4 GiB gets the cap, 16 GiB 2,048.
    assert auto_interval(150 * mib, 4 * gib) == 4096
    assert auto_interval(150 * mib, 16 * gib) == 2048
    for size, budget in ((3 * mib, gib), (75 * mib, 16 * gib), (mib, 10 * mib)):
        n = auto_interval(size, budget)
        assert n & (n - 1) == 0 and 64 <= n <= 4096
        assert n == 4096 or (32_768 // n) * size <= budget // 4
        assert n == 64 or (32_768 // (n // 2)) * size > budget // 4


def test_lookup_trimmable_entry_serves_any_prefix() -> None:
    store = CheckpointStore(10_000)
    _put(store, list(range(50)), trimmable=True)
    m = store.lookup([*range(30), 99])
    assert m is not None and m.pos == 30 and m.checkpoint is None
    # An exact repeat keeps one token to recompute (its logits start the generation).
    m = store.lookup(list(range(50)))
    assert m is not None and m.pos == 49
    assert store.lookup([7, 8]) is None


def test_lookup_non_trimmable_uses_checkpoint_below_match_or_entry_end() -> None:
    store = CheckpointStore(10_000)
    _put(store, list(range(50)), checkpoints={10: 5, 20: 5, 40: 5})
    m = store.lookup([*range(35), 99])
    assert m is not None and (m.pos, m.checkpoint and m.checkpoint.pos, m.lcp) == (20, 20, 35)
    m = store.lookup(list(range(20)))  # checkpoint at 20 would leave nothing to recompute
    assert m is not None and m.pos == 10
    m = store.lookup([*range(50), 1, 2])  # a longer prompt continues from the entry's end
    assert m is not None and m.pos == 50 and m.checkpoint is None
    assert store.lookup([*range(9), 99]) is None


def test_lookup_trims_a_trimmable_checkpoint_above_the_limit() -> None:
    # An unwrapped sliding window (checkpoints below 128) serves any shorter prefix of it.
    store = CheckpointStore(10_000)
    _put(store, list(range(300)), checkpoints={40: 5, 100: 5, 200: 5}, trim_below=128)
    m = store.lookup([*range(7), 99])
    assert m is not None and (m.pos, m.checkpoint and m.checkpoint.pos, m.lcp) == (7, 40, 7)
    m = store.lookup([*range(70), 99])  # the nearest trimmable checkpoint above the limit
    assert m is not None and (m.pos, m.checkpoint and m.checkpoint.pos) == (70, 100)
    m = store.lookup(list(range(40)))  # an exact repeat of the prefix still recomputes 1 token
    assert m is not None and (m.pos, m.checkpoint and m.checkpoint.pos) == (39, 40)
    # Above the last trimmable one only a wrapped checkpoint at or below the limit serves.
    m = store.lookup([*range(150), 99])
    assert m is not None and (m.pos, m.checkpoint and m.checkpoint.pos) == (100, 100)
    m = store.lookup([*range(250), 99])
    assert m is not None and (m.pos, m.checkpoint and m.checkpoint.pos) == (200, 200)


def test_lookup_never_trims_a_non_trimmable_checkpoint() -> None:
    store = CheckpointStore(10_000)
    _put(store, list(range(300)), checkpoints={40: 5, 100: 5})  # recurrent state: exact only
    assert store.lookup([*range(7), 99]) is None
    m = store.lookup([*range(70), 99])
    assert m is not None and (m.pos, m.checkpoint and m.checkpoint.pos) == (40, 40)


def test_lookup_prefers_the_restore_reusing_most_tokens() -> None:
    store = CheckpointStore(10_000)
    _put(store, [*range(20), *range(500, 600)], checkpoints={30: 5}, trim_below=128)
    _put(store, list(range(200)), checkpoints={16: 5, 150: 5})
    m = store.lookup([*range(25), 99])  # 20 by trimming the first entry, 16 from the second
    assert m is not None and m.pos == 20 and m.checkpoint is not None and m.checkpoint.pos == 30
    m = store.lookup([*range(160), 99])
    assert m is not None and m.pos == 150


def test_absorbed_entry_end_keeps_its_trimmability() -> None:
    store = CheckpointStore(10_000)
    _put(store, list(range(40)))
    entry = store.begin(list(range(300)))
    store.finish(entry, list(range(300)), "kv", 10, False,
                 lambda e: ("end", 7, len(e.tokens) < 128))
    assert entry.checkpoints[40].trimmable
    m = store.lookup([*range(12), 99])
    assert m is not None and (m.pos, m.checkpoint and m.checkpoint.pos) == (12, 40)


def test_finish_absorbs_prefix_entries_and_takes_over_checkpoints() -> None:
    store = CheckpointStore(10_000)
    first = _put(store, list(range(40)), checkpoints={10: 5})
    side = _put(store, [*range(30), 77, 78], checkpoints={20: 5, 31: 5})
    entry = store.begin(list(range(60)))
    store.finish(entry, list(range(60)), "kv", 10, False,
                 lambda e: (f"end{len(e.tokens)}", 7, False))
    assert first not in store.entries  # its KV is covered by the new entry's
    assert sorted(entry.checkpoints) == [10, 20, 40]  # 20 came from `side`, 40 is first's end
    assert entry.checkpoints[40].payload == "end40"
    assert sorted(side.checkpoints) == [31]
    assert store.bytes_used == _accounted(store)


def test_budget_never_exceeded_and_oversized_item_rejected() -> None:
    store = CheckpointStore(100)
    e = _put(store, list(range(10)), nbytes=150)
    assert e not in store.entries and store.bytes_used == 0 and store.rejected == 1


def test_dense_checkpoints_go_before_sequences() -> None:
    store = CheckpointStore(100)
    conv = _put(store, list(range(500)), nbytes=40,
                checkpoints={100: 10, 200: 10, 204: 10, 300: 10, 400: 10})
    assert store.bytes_used == 90
    _put(store, [1000 + i for i in range(300)], nbytes=20)
    assert conv in store.entries
    assert 204 not in conv.checkpoints  # the one 4 tokens from its neighbour
    assert store.bytes_used <= 100


def test_pressure_thins_uniform_checkpoints_evenly() -> None:
    store = CheckpointStore(1000)
    conv = _put(store, list(range(1100)), nbytes=200,
                checkpoints={p: 50 for p in range(64, 1024 + 1, 64)})  # 16 x 50 bytes
    assert store.bytes_used == 1000
    # A new 300-byte request: evicting 6 of the 16 checkpoints must not open one large hole.
    _put(store, [5000 + i for i in range(600)], nbytes=300)
    positions = sorted(conv.checkpoints)
    gaps = [b - a for a, b in pairwise([0, *positions])]
    assert conv in store.entries and store.bytes_used <= 1000 and len(positions) == 10
    assert max(gaps) <= 128


def test_pressure_drops_an_interval_checkpoint_before_the_boundary_above_it() -> None:
    # A system prompt ends at 610, 34 tokens after the interval mark at 576: new conversations
    # restore at 610, only an edit inside the system prompt would use 576.
    marks = placement_marks(700, 0, [610], 64, 4)
    assert (marks[576], marks[610], marks[674], marks[696]) == (True, False, True, False)
    store = CheckpointStore(1000)
    entry = store.begin(list(range(700)))
    for pos, interval in marks.items():
        if pos < 700:
            store.add_checkpoint(entry, pos, None, 10, interval)
    store.finish(entry, list(range(700)), "kv", 1000 - 10 * len(entry.checkpoints), False,
                 _no_end)
    before = set(entry.checkpoints)
    _put(store, [5000 + i for i in range(300)], nbytes=40)  # needs 4 of the checkpoints
    # 696 (dense: 22 tokens) goes first, then interval marks, not the boundary.
    assert 696 in before - set(entry.checkpoints)
    assert 610 in entry.checkpoints and len(entry.checkpoints) == len(before) - 4
    assert store.bytes_used <= 1000


def test_zero_byte_items_are_not_evicted_for_nothing() -> None:
    store = CheckpointStore(100)
    conv = _put(store, list(range(1000)), nbytes=60, checkpoints={100: 0, 200: 0, 300: 1})
    _put(store, [5000 + i for i in range(200)], nbytes=40)
    assert sorted(conv.checkpoints) == [100, 200]  # only the 1-byte one had to go


def test_short_request_does_not_evict_long_conversation() -> None:
    store = CheckpointStore(1000)
    conv = _put(store, list(range(20_000)), nbytes=900, checkpoints={10_000: 50})
    title = _put(store, [5000 + i for i in range(60)], nbytes=100)
    assert conv in store.entries and 10_000 in conv.checkpoints
    assert title not in store.entries
    # Once the conversation has been idle for very many requests, it gives way.
    for _ in range(1000):
        store.discard(store.begin([1]))
    newer = _put(store, [9000 + i for i in range(60)], nbytes=100)
    assert newer in store.entries and store.bytes_used <= 1000


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 300), st.integers(0, 400),
                          st.lists(st.integers(1, 120), max_size=6)), min_size=1, max_size=40),
       st.integers(50, 1500))
def test_random_inserts_never_exceed_budget(ops: list[tuple[int, int, int, list[int]]],
                                            budget: int) -> None:
    store = CheckpointStore(budget)
    for family, length, size, ckpt_sizes in ops:
        # Four families of prompts sharing long prefixes, so hand-over and absorption happen.
        tokens = [family * 10_000 + i for i in range(length)]
        store.lookup(tokens)
        entry = store.begin(tokens)
        for k, csize in enumerate(ckpt_sizes):
            pos = (k + 1) * max(1, length // (len(ckpt_sizes) + 1))
            store.add_checkpoint(entry, pos, None, csize)
            assert store.bytes_used <= budget
        store.finish(entry, tokens, None, size, bool(size % 2),
                     lambda e: (None, 3, len(e.tokens) < 100) if e.tokens else None)
        assert store.bytes_used <= budget
        assert store.bytes_used == _accounted(store)
        for e in store.entries:
            assert all(p < len(e.tokens) for p in e.checkpoints)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.integers(1, 300)), max_size=12),
       st.integers(1000, 5000), st.lists(st.integers(0, 60), max_size=8),
       st.integers(1, 200), st.integers(0, 2000))
def test_short_request_costs_a_recent_conversation_at_most_its_own_length(
        history: list[tuple[int, int]], conv_len: int, ckpt_sizes: list[int], short_len: int,
        short_bytes: int) -> None:
    budget = 2000
    store = CheckpointStore(budget)
    for k, (length, size) in enumerate(history):
        _put(store, [(k + 1) * 100_000 + i for i in range(length)], nbytes=size)
    conv_tokens = list(range(conv_len))
    step = conv_len // (len(ckpt_sizes) + 1)
    conv = _put(store, conv_tokens, nbytes=600,
                checkpoints={(k + 1) * step: s for k, s in enumerate(ckpt_sizes)})
    assert conv in store.entries  # worth more than any shorter, older entry
    # The next turn continues the conversation; an edit re-uses a checkpoint inside it.
    turns = ([*conv_tokens, -1], [*conv_tokens[:conv_len - 10], -1])
    before = [store.lookup(t) for t in turns]
    _put(store, [-(i + 2) for i in range(short_len)], nbytes=short_bytes)
    assert store.bytes_used <= budget
    assert conv in store.entries
    for turn, old in zip(turns, before, strict=True):
        new = store.lookup(turn)
        assert (new.pos if new else 0) >= (old.pos if old else 0) - short_len
