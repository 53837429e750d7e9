"""The publisher's diff (kvevents/forest.py) against the subscriber's index (kvevents/index.py):
what a tier announces, read back by a fresh `Held`, credits every prompt exactly what the tier
can restore of it, computed here by brute force over the token paths, and stays so as the
holdings change (removals, blocks whose parent changes), over one medium or two."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixd.kvevents import wire
from prefixd.kvevents.forest import Announced, restorable_positions
from prefixd.kvevents.index import Held
from prefixd.kvevents.prefix import CHUNK, Path, seed_key

SEED = seed_key("a model")      # the publisher's: the subscriber never sees it
VOCAB = 3                       # a small vocabulary: paths share prefixes
MAX_LEN = 200

# a tier's holdings as plain data: (tokens, the positions that restore)
Plain = list[tuple[list[int], list[int]]]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def brute_held(tiers: Iterable[Plain], prompt: Sequence[int]) -> int:
    """The furthest restorable position a prompt can use: on a path it shares up to there,
    and at most its length minus one (the last token is always computed)."""
    best = 0
    for holdings in tiers:
        for tokens, positions in holdings:
            reach = min(common_prefix(tokens, prompt), len(prompt) - 1)
            best = max([best, *(p for p in positions if p <= reach)])
    return best


def holdings_of(plain: Plain) -> list[tuple[Path, list[int]]]:
    return [(Path(SEED, tokens), positions) for tokens, positions in plain]


def through_the_wire(events: list[wire.Event], encoding: str) -> tuple[wire.Event, ...]:
    return wire.decode(wire.encode(wire.Batch(1.0, tuple(events)), encoding)).events


class Reader:
    """An independent reading of the stream: block id -> the token prefix it stands for,
    rebuilt from each BlockStored's parent and token ids; what is live now."""

    def __init__(self) -> None:
        self.prefix: dict[int, tuple[int, ...]] = {}

    def apply(self, events: Iterable[wire.Event]) -> None:
        for e in events:
            if isinstance(e, wire.BlockRemoved):
                for h in e.block_hashes:
                    self.prefix.pop(h, None)
            elif isinstance(e, wire.BlockStored):
                assert len(e.block_hashes) >= 1 and e.block_size > 0
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                if e.parent_block_hash is None:
                    base: tuple[int, ...] = ()
                else:
                    assert e.parent_block_hash in self.prefix, "a parent not announced before"
                    base = self.prefix[e.parent_block_hash]
                for i, h in enumerate(e.block_hashes):
                    base = base + e.token_ids[i * e.block_size:(i + 1) * e.block_size]
                    self.prefix[h] = base

    def announced(self) -> set[tuple[int, ...]]:
        return set(self.prefix.values())


def restorable(plain: Plain) -> set[tuple[int, ...]]:
    return {tuple(tokens[:p]) for tokens, positions in plain for p in positions}


tok = st.integers(1, VOCAB)


@st.composite
def tokens_upto(draw: st.DrawFn, most: int) -> list[int]:
    """Up to `most` tokens, any length equally likely (hypothesis' lists stay short)."""
    n = draw(st.integers(0, most))
    rnd = draw(st.randoms(use_true_random=False))
    return [rnd.randint(1, VOCAB) for _ in range(n)]


@st.composite
def token_paths(draw: st.DrawFn, n_max: int = 6) -> list[list[int]]:
    """Paths that share prefixes: most branch off an earlier one."""
    paths: list[list[int]] = []
    for _ in range(draw(st.integers(1, n_max))):
        if paths and draw(st.integers(0, 3)):
            base = draw(st.sampled_from(paths))
            cut = draw(st.integers(0, len(base)))
            paths.append(base[:cut] + draw(tokens_upto(MAX_LEN - cut)))
        else:
            paths.append(draw(tokens_upto(MAX_LEN)))
    return paths


@st.composite
def restore_positions(draw: st.DrawFn, tokens: list[int]) -> list[int]:
    n = len(tokens)
    trims_to = draw(st.sampled_from([0, n]) | st.integers(0, n + 5))
    points = draw(st.lists(st.integers(0, n + 3), max_size=8))
    return restorable_positions(n, trims_to, points)


@st.composite
def holdings(draw: st.DrawFn) -> Plain:
    return [(tokens, draw(restore_positions(tokens))) for tokens in draw(token_paths())]


@st.composite
def changed(draw: st.DrawFn, plain: Plain) -> Plain:
    """A later state of the same tier: paths dropped, kept, re-trimmed, new ones."""
    out: Plain = []
    for tokens, positions in plain:
        what = draw(st.sampled_from(["drop", "keep", "retrim", "subset"]))
        if what == "keep":
            out.append((tokens, positions))
        elif what == "retrim":
            out.append((tokens, draw(restore_positions(tokens))))
        elif what == "subset":
            out.append((tokens, sorted(draw(st.sets(st.sampled_from(positions)))
                                       if positions else [])))
    for tokens in draw(token_paths(3)) if draw(st.booleans()) else []:
        out.append((tokens, draw(restore_positions(tokens))))
    return out


@st.composite
def prompts_for(draw: st.DrawFn, tiers: list[Plain]) -> list[list[int]]:
    paths = [tokens for plain in tiers for tokens, _ in plain]
    out: list[list[int]] = [[], [1], *paths]
    for tokens in paths:
        for _ in range(3):
            out.append(tokens[:draw(st.integers(0, len(tokens)))])
            out.append(tokens + draw(st.lists(tok, min_size=1, max_size=20)))
            if tokens:
                i = draw(st.integers(0, len(tokens) - 1))
                wrong = tokens[i] % VOCAB + 1
                out.append([*tokens[:i], wrong, *tokens[i + 1:]])
                out.append([*tokens[:i], wrong])
        for p in (CHUNK, 2 * CHUNK, len(tokens) - 1, len(tokens) + 1):
            if 0 < p <= len(tokens) + 1:
                out.append(([*tokens, 1])[:p])
    out += draw(st.lists(st.lists(tok, max_size=60), max_size=5))
    return out


def check(held: Held, tiers: list[Plain], prompts: list[list[int]]) -> None:
    for prompt in prompts:
        assert held.held(prompt) == brute_held(tiers, prompt), prompt


def announce(announced: Announced, plain: Plain, reader: Reader, held: Held,
             encoding: str) -> list[wire.Event]:
    events = list(through_the_wire(announced.update(holdings_of(plain)), encoding))
    reader.apply(events)
    for e in events:
        held.apply(e)
    return events


PROPERTY = settings(max_examples=80, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@PROPERTY
@given(data=st.data(), first=holdings(), encoding=st.sampled_from(wire.ENCODINGS))
def test_held_is_exactly_what_restores(data: st.DataObject, first: Plain, encoding: str) -> None:
    gpu, held, reader = Announced("GPU"), Held(), Reader()
    announce(gpu, first, reader, held, encoding)
    assert reader.announced() == restorable(first)      # all of it, and nothing else
    check(held, [first], data.draw(prompts_for([first])))
    assert held.counts["unplaced"] == held.counts["malformed"] == 0

    assert gpu.update(holdings_of(first)) == []         # nothing changed: nothing to say

    second = data.draw(changed(first))
    announce(gpu, second, reader, held, encoding)
    assert reader.announced() == restorable(second)
    check(held, [second], data.draw(prompts_for([first, second])))
    assert held.counts["unplaced"] == held.counts["malformed"] == 0

    third = data.draw(changed(second))
    announce(gpu, third, reader, held, encoding)
    assert reader.announced() == restorable(third)
    check(held, [third], data.draw(prompts_for([second, third])))


@st.composite
def two_tiers(draw: st.DrawFn) -> tuple[Plain, Plain]:
    """Two tiers over the same paths (most held by both, at positions of their own), and
    some of their own."""
    paths = draw(token_paths())
    tiers: list[Plain] = [[], []]
    for tokens in paths:
        for tier in draw(st.sampled_from([(0,), (1,), (0, 1), (0, 1)])):
            tiers[tier].append((tokens, draw(restore_positions(tokens))))
    return tiers[0], tiers[1]


@PROPERTY
@given(data=st.data(), tiers=two_tiers())
def test_two_media_into_one_held(data: st.DataObject, tiers: tuple[Plain, Plain]) -> None:
    """GPU and DISK announce separately into one index, each changing in turn: a prompt is
    credited exactly what either tier restores; a tier dropping something the other still
    holds takes nothing from it."""
    gpu_plain, disk_plain = tiers
    gpu, disk, held = Announced("GPU"), Announced("DISK"), Held()
    gpu_reader, disk_reader = Reader(), Reader()

    def check_both() -> None:
        both = [gpu_plain, disk_plain]
        check(held, both, data.draw(prompts_for(both)))

    announce(gpu, gpu_plain, gpu_reader, held, wire.MAP)
    announce(disk, disk_plain, disk_reader, held, wire.ARRAY)
    check_both()
    gpu_plain = data.draw(changed(gpu_plain))
    announce(gpu, gpu_plain, gpu_reader, held, wire.MAP)
    check_both()
    disk_plain = data.draw(changed(disk_plain))
    announce(disk, disk_plain, disk_reader, held, wire.ARRAY)
    check_both()
    assert gpu_reader.announced() == restorable(gpu_plain)
    assert disk_reader.announced() == restorable(disk_plain)


def test_gpu_dropping_a_parent_keeps_what_disk_holds_below_it() -> None:
    """The smallest case hypothesis found against an earlier index: GPU restores [1, 1] at 1
    and 2, DISK at 2 only (a block of 2 tokens, no parent). Stored GPU first, the index placed
    the block at 2 below GPU's block at 1; GPU then dropped both, and DISK's went along."""
    tokens = [1, 1]
    gpu, disk, held = Announced("GPU"), Announced("DISK"), Held()
    for e in [*gpu.update([(Path(SEED, tokens), [1, 2])]),
              *disk.update([(Path(SEED, tokens), [2])])]:
        held.apply(e)
    assert held.held([*tokens, 1]) == 2
    for e in gpu.update([]):
        held.apply(e)
    assert held.held([*tokens, 1]) == 2, "DISK's block went with GPU's parent of it"


def test_a_block_removed_from_gpu_that_disk_holds_stays_credited() -> None:
    tokens = [1, 2, 3] * 20                    # 60 tokens
    positions = restorable_positions(len(tokens), 48, [])
    assert positions == [16, 32, 48]
    gpu, disk, held = Announced("GPU"), Announced("DISK"), Held()
    for e in gpu.update([(Path(SEED, tokens), positions)]):
        held.apply(e)
    for e in disk.update([(Path(SEED, tokens), positions)]):
        held.apply(e)
    prompt = [*tokens, 9]
    assert held.held(prompt) == 48
    events = gpu.update([])
    assert events and all(isinstance(e, wire.BlockRemoved) and e.medium == "GPU"
                          for e in events)
    for e in events:
        held.apply(e)
    assert held.held(prompt) == 48              # DISK still has all of it
    for e in disk.update([(Path(SEED, tokens), [16])]):
        held.apply(e)
    assert held.held(prompt) == 16
    for e in disk.update([]):
        held.apply(e)
    assert held.held(prompt) == 0


def test_blocks_below_a_removed_one_are_announced_again() -> None:
    """A path restoring at 16, 32, 48, then (trimmed differently) only at 32 and 48: 16 goes,
    32's parent changes, 48 hangs below 32 unchanged. A consumer that drops what hangs below
    a removed block must get 48 back."""
    tokens = [1, 2] * 30
    path = Path(SEED, tokens)
    gpu, held, reader = Announced("GPU"), Held(), Reader()
    for e in gpu.update([(path, [16, 32, 48])]):
        held.apply(e)
        reader.apply([e])
    assert held.held(tokens) == 48
    events = gpu.update([(path, [32, 48])])
    reader.apply(events)
    for e in events:
        held.apply(e)
    assert reader.announced() == {tuple(tokens[:32]), tuple(tokens[:48])}
    assert held.held(tokens) == 48
    assert held.held(tokens[:40]) == 32
    assert held.held(tokens[:20]) == 0


def test_a_chain_of_whole_chunks_is_one_event() -> None:
    tokens = list(range(1, 70))
    events = Announced("GPU").update([(Path(SEED, tokens), [16, 32, 48, 64, 69])])
    stored = [e for e in events if isinstance(e, wire.BlockStored)]
    assert [(len(e.block_hashes), e.block_size, len(e.token_ids)) for e in stored] == [
        (4, CHUNK, 4 * CHUNK), (1, 5, 5)]
    assert stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
    assert list(stored[0].token_ids) + list(stored[1].token_ids) == tokens
    assert all(e.medium == "GPU" for e in stored)


def test_same_prefix_from_two_paths_is_one_block() -> None:
    a, b = [1] * 40, [1] * 32 + [2] * 8
    events = Announced("GPU").update([(Path(SEED, a), [16, 32, 40]),
                                      (Path(SEED, b), [16, 32, 40])])
    ids = [h for e in events if isinstance(e, wire.BlockStored) for h in e.block_hashes]
    assert len(ids) == len(set(ids)) == 4      # 16 and 32 once, each path's 40


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 47, 48, 100])
def test_restorable_positions(n: int) -> None:
    for trims_to in range(0, n + 20, 3):
        for points in ([], [n], [1, n + 1, -2, 0, 7, 33]):
            want = {p for p in range(1, n + 1)
                    if (p % CHUNK == 0 and p <= trims_to) or p == min(trims_to, n)
                    or p in points}
            assert restorable_positions(n, trims_to, points) == sorted(want)
