"""Truth from the backend (issue 17 item 2), pure parts: the worker's digest of what it can
restore of a request's tokens (read from the checkpoint store), and the prefix index recording
each boundary with what the backend restores for it."""

from __future__ import annotations

import pytest

from prefixd.backends.mlx.cache.store import CheckpointStore, Entry
from prefixd.backends.mlx.engine.restorable import MAX_POSITIONS, restorable
from prefixd.proxy.routing.index import Boundary, Chain, PrefixIndex, Restorable

T = list(range(1000, 1300))        # a request's tokens (prompt + reply as stored)


def _end(_: Entry) -> tuple[str, int, bool]:
    """The end state of an absorbed entry, as a (non-trimmable) checkpoint."""
    return "end", 1, False


def _serve(store: CheckpointStore, tokens: list[int], checkpoints: dict[int, bool] = {},  # noqa: B006
           trimmable: bool = False, nbytes: int = 10) -> Entry:
    """One request as the Engine runs it: begin, checkpoints {pos: trimmable}, finish."""
    entry = store.begin(tokens[:-5])
    for pos, trims in checkpoints.items():
        store.add_checkpoint(entry, pos, f"ckpt{pos}", 1, trimmable=trims)
    store.finish(entry, tokens, "kv", nbytes, trimmable, _end)
    return entry


def _digest(store: CheckpointStore) -> tuple[list[int], int, bool]:
    d = restorable(store, store.latest)
    return d["positions"], d["prefix_to"], d["any_prefix"]


def test_a_hybrid_entry_restores_at_its_checkpoints_and_end() -> None:
    store = CheckpointStore(10_000)
    _serve(store, T[:200], {40: False, 168: False, 190: False})
    assert _digest(store) == ([40, 168, 190, 200], 0, False)


def test_a_pure_kv_entry_restores_any_prefix() -> None:
    store = CheckpointStore(10_000)
    _serve(store, T[:200], trimmable=True)
    assert _digest(store) == ([200], 200, True)


def test_unwrapped_window_checkpoints_serve_every_prefix_below_them() -> None:
    store = CheckpointStore(10_000)
    _serve(store, T[:200], {60: True, 150: False})
    assert _digest(store) == ([60, 150, 200], 60, False)


def test_checkpoints_of_an_earlier_turn_count_once_merged() -> None:
    store = CheckpointStore(10_000)
    _serve(store, T[:100], {40: False, 90: False})           # turn 1
    _serve(store, T[:100] + [7] * 50, {130: False})          # turn 2 extends it
    assert _digest(store) == ([40, 90, 100, 130, 150], 0, False)
    _serve(store, T[:60] + [8] * 40, {80: False})            # an edit after 60 tokens
    assert _digest(store) == ([40, 80, 100], 0, False)


def test_a_trimmable_state_of_another_entry_serves_the_shared_prefix() -> None:
    store = CheckpointStore(10_000)
    _serve(store, T[:100], {95: True})                        # windows unwrapped to 95
    _serve(store, T[:50] + [9] * 50, {70: False})             # shares 50 tokens
    assert _digest(store) == ([50, 70, 100], 50, False)


def test_evicted_checkpoints_are_not_listed() -> None:
    store = CheckpointStore(10_000)
    entry = store.begin(T[:195])
    for pos in (20, 30, 40, 100):
        store.add_checkpoint(entry, pos, "s", 30)
    store.budget = 200           # the entry's KV (100) only fits if its densest checkpoints go
    store.finish(entry, T[:200], "kv", 100, False, _end)
    assert _digest(store) == ([20, 40, 100, 200], 0, False)   # 30: the smallest gap, 10


def test_a_rejected_or_discarded_request_lists_what_other_entries_restore() -> None:
    store = CheckpointStore(1000)
    _serve(store, T[:100], trimmable=True, nbytes=100)
    rejected = store.begin(T[:40] + [5] * 60)
    store.finish(rejected, T[:40] + [5] * 70, "kv", 5000, True, _end)  # over the budget
    assert rejected not in store.entries
    assert _digest(store) == ([40], 40, True)
    dropped = store.begin(T[:30] + [6] * 10)
    store.discard(dropped)
    assert _digest(store) == ([30], 30, True)


def test_nothing_stored_nothing_restorable() -> None:
    store = CheckpointStore(10_000)
    assert _digest(store) == ([], 0, False)


def test_the_digest_keeps_the_highest_positions() -> None:
    store = CheckpointStore(10_000)
    _serve(store, T[:300], {p: False for p in range(2, 290, 2)})
    positions, _, _ = _digest(store)
    assert len(positions) == MAX_POSITIONS == 64
    assert positions == [*range(164, 290, 2), 300]


# --- the proxy's index ------------------------------------------------------------------------

# Four boundaries estimated at 10, 40, 80, 100 tokens; the backend reports 200 prompt tokens,
# so they are taken at 20, 80, 160, 200 before the digest says what it restores.
BOUNDS = [Boundary(f"k{i}", t) for i, t in enumerate((10, 40, 80, 100))]


@pytest.mark.parametrize(("digest", "recorded"), [
    (None, [20, 80, 160, 200]),                                  # llama-server, vLLM, ...
    (Restorable((205,), 205), [20, 80, 160, 200]),               # any prefix (pure KV)
    # a hybrid: the largest position at or below each (within 16 tokens above it)
    (Restorable((20, 75, 150, 200, 205)), [20, 75, 150, 205]),
    (Restorable((36, 96, 176, 216)), [36, 96, 176, 216]),        # 16 above: in the slack
    (Restorable((37, 97, 177, 217)), [None, 37, 97, 177]),       # 17 above: the one below
    # nothing at or below the first two: they are not recorded at all
    (Restorable((150, 200)), [None, None, 150, 200]),
    # every prefix up to 100 restores (unwrapped windows), and the checkpoint at 150
    (Restorable((150,), 100), [20, 80, 150, 150]),
    (Restorable(()), [None, None, None, None]),
])
def test_index_records_what_the_backend_restores(digest, recorded) -> None:
    """`recorded`: the tokens each boundary is recorded with (None: not recorded)."""
    idx = PrefixIndex()
    idx.record("a", Chain(BOUNDS, 1), now=0.0, exact_tokens=200, restorable=digest, slack=16)
    for k in range(1, 5):   # a request ending at boundary k gets the deepest recorded one
        below = [r for r in recorded[:k] if r is not None]
        assert idx.longest(Chain(BOUNDS[:k], 1), now=0.0)["a"] == (
            below[-1] if below else 0, bool(below)), k
    assert idx.size("a") == len([r for r in recorded if r is not None])


def test_a_digest_drops_what_an_earlier_record_claimed() -> None:
    idx = PrefixIndex()
    idx.record("a", Chain(BOUNDS, 1), now=0.0, exact_tokens=200)
    idx.record("a", Chain(BOUNDS, 1), now=1.0, exact_tokens=200,
               restorable=Restorable((150, 200)), slack=16)
    assert idx.longest(Chain(BOUNDS[:2], 1), now=1.0)["a"] == (0, False)
    assert idx.longest(Chain(BOUNDS, 1), now=1.0)["a"] == (200, True)


def test_an_estimated_boundary_is_credited_no_further_than_the_workers_message_mark() -> None:
    """The gateway bench's misprediction: a ~1,900-token system prompt of rules, then turns of
    code; scaled by the whole prompt's tokens per character, the system prompt's boundary is
    estimated at 1,980 tokens where it ends at 1,916, and the worker's checkpoint of a later
    turn at 1,980 was credited to every conversation sharing the system prompt. With the
    worker's message marks (`boundaries` in its digest) it is credited 1,916; without them
    (an older worker) as before."""
    positions = (*range(71, 1916, 64), 1916, 1980, 2044, 3679)
    chain = Chain([Boundary("system", 884), Boundary("turn 5", 1609)], 1)
    other = Chain([Boundary("system", 884), Boundary("other", 995)], 1)
    for marks, system in (((1916, 3679), 1916), ((), 1980)):
        idx = PrefixIndex()
        idx.record("b0", chain, 0.0, 3679, Restorable(positions, 0, marks), 16)
        assert idx.longest(other, 0.0)["b0"] == (system, True)
        assert idx.longest(chain, 0.0)["b0"] == (3679, True)      # the exact end: as it was
    digest = Restorable.from_digest({"restorable": {"positions": list(positions),
                                                    "prefix_to": 0, "boundaries": [1916, 3679]}})
    assert digest is not None and digest.boundaries == (1916, 3679)


def test_the_digest_names_the_message_marks_not_the_interval_marks() -> None:
    store = CheckpointStore(10_000)
    entry = store.begin(T[:195])
    for pos, interval in ((40, False), (104, True), (168, True), (190, False)):
        store.add_checkpoint(entry, pos, f"ckpt{pos}", 1, interval=interval)
    store.finish(entry, T[:200], "kv", 10, False, _end)
    d = restorable(store, store.latest)
    assert d["positions"] == [40, 104, 168, 190, 200] and d["boundaries"] == [40, 190]
