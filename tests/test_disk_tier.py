"""The disk tier of the worker's prompt cache, in-process: warm after a restart == cold on every
tiny architecture, each byte written once, the budget kept, bad files skipped, and every lookup
that restores less than the worker knew names a reason.

A "restart" is a new Engine over the same directory (the worker process is tested in
tests/test_disk_worker.py). Expected numbers come from the prompts, not from the code: a
finished turn holds its prompt and every generated token (MAX_TOKENS), so a next turn that
extends it restores exactly `len(prompt) + MAX_TOKENS` tokens.
"""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_checkpoints import MAX_TOKENS, _cold, _run
from test_checkpoints import _assert_same as _same  # warm == cold, within LOGPROB_ATOL
from test_checkpoints import _settings as _config

from prefixd.backends.mlx.disk import fmt as diskfmt
from prefixd.backends.mlx.engine.engine import Engine, EngineConfig
from prefixd.backends.mlx.engine.tierglue import DiskSpec
from prefixd.backends.mlx.model.tiny import ARCHS, build_model
from prefixd.backends.mlx.scheduler.writes import hand_over

BOUNDS = (60, 150, 220)
BLOCK = 64


def _engine(model: Any, root: Path, budget: int = 1 << 30, delay: float = 0.0,
            **kw: Any) -> Engine:
    return Engine(model, _config(**kw), DiskSpec(root, "test-model", budget, delay, BLOCK))


def _words(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def _stop(engine: Engine) -> None:
    """What the worker does at SIGTERM: write everything, wait for the writer."""
    engine.persist()
    assert engine.close(30.0)


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*" + diskfmt.SUFFIX)]


@pytest.fixture(scope="module", params=ARCHS)
def model(request: pytest.FixtureRequest) -> Any:
    return build_model(request.param, seed=3)


def test_warm_after_restart_equals_cold(model: Any, tmp_path: Path) -> None:
    base = _words(1, 300)
    first = _engine(model, tmp_path)
    reply = _run(first, base, BOUNDS)[0]
    _stop(first)

    again = _engine(model, tmp_path)
    # the next turn extends the whole first turn (prompt + reply)
    prompt = base + reply + _words(2, 30)
    warm = _run(again, prompt)
    assert (warm[2].cached_tokens, warm[2].tier, warm[2].miss) == (300 + MAX_TOKENS, "disk",
                                                                   None)
    _same(warm, _cold(model, prompt))
    again.close(5)
    # an edit inside the history restores a checkpoint below the edit, from disk
    edited = base[:170] + _words(3, 20)
    third = _engine(model, tmp_path)
    warm = _run(third, edited)
    assert warm[2].tier == "disk" and 0 < warm[2].cached_tokens <= 170
    _same(warm, _cold(model, edited))
    third.close(5)


def test_each_block_is_written_once_and_superseded_turns_never(tmp_path: Path) -> None:
    model = build_model("qwen3_next", seed=3)
    engine = _engine(model, tmp_path, delay=3600.0)    # nothing is idle long enough
    prompt = _words(4, 150)
    for turn in range(4):
        reply = _run(engine, prompt, (len(prompt) - 20,))[0]
        prompt = prompt + reply + _words(10 + turn, 70)
    assert not _files(tmp_path), "an active conversation was written before it went idle"
    (entry,) = engine.store.entries
    hand_over(engine, engine.lockstep, math.inf)
    assert engine.close(30.0)
    info = engine.cache_info()["disk"]
    assert info["written_blocks"] == len(entry.tokens) // BLOCK
    assert info["written_records"] == len(entry.checkpoints) + 1
    # A second flush of the same state writes nothing.
    engine2 = _engine(model, tmp_path, delay=3600.0)
    _run(engine2, [*entry.tokens, 7])
    engine2.persist()
    assert engine2.close(30.0)
    assert engine2.cache_info()["disk"]["written_blocks"] <= 1


def test_ram_eviction_writes_to_disk_and_serves_from_it(tmp_path: Path) -> None:
    model = build_model("qwen3_5", seed=3)
    one, two = _words(20, 400), _words(21, 1500)    # the longer one is worth more
    probe = Engine(model, _config())
    _run(probe, two, (100,))
    budget = probe.store.entries[0].nbytes * 13 // 10      # the second one's KV, not both
    engine = _engine(model, tmp_path, delay=3600.0, cache_bytes=budget,
                     checkpoint_interval=1024)
    reply = _run(engine, one, (100,))[0]
    _run(engine, two, (100,))
    assert all(e.tokens[:10] != one[:10] for e in engine.store.entries), "one is still in RAM"
    assert engine.tiers.disk.drain(30.0)
    prompt = one + reply + _words(22, 10)
    warm = _run(engine, prompt)
    assert (warm[2].cached_tokens, warm[2].tier) == (400 + MAX_TOKENS, "disk")
    _same(warm, _cold(model, prompt))
    engine.close(5)


def test_disk_budget_is_never_exceeded(tmp_path: Path) -> None:
    model = build_model("gemma3_text", seed=3)
    budget = 400_000
    engine = _engine(model, tmp_path, budget=budget)
    for i in range(8):
        _run(engine, _words(30 + i, 260), (100,))
        hand_over(engine, engine.lockstep, math.inf)
        assert engine.tiers.disk.drain(30.0)
        on_disk = sum(p.stat().st_size for p in _files(tmp_path))
        assert on_disk <= budget
        assert engine.cache_info()["disk"]["bytes_used"] == on_disk
    assert engine.cache_info()["disk"]["evicted_records"] > 0
    engine.close(5)


def test_bad_files_are_skipped_with_one_log_line(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    model = build_model("qwen3_next", seed=3)
    base = _words(40, 200)
    engine = _engine(model, tmp_path)
    reply = _run(engine, base, (80,))[0]
    _stop(engine)
    (key_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    records = sorted((key_dir / "records").iterdir(), key=lambda p: p.stat().st_size)
    end = max(records, key=lambda p: diskfmt.describe(p)[0]["pos"])
    end.write_bytes(end.read_bytes()[:-100])                         # truncated
    (key_dir / "records" / ("0" * 32 + diskfmt.SUFFIX)).write_bytes(b"not a cache file")
    (key_dir / "blocks" / "notes.txt").write_text("foreign")
    (key_dir / "records" / ".x.safetensors.123.tmp").write_bytes(b"partial")  # a crashed write
    caplog.set_level(logging.INFO, logger="prefixd.worker.disk")
    again = _engine(model, tmp_path)
    lines = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1
    skipped = again.cache_info()["disk"]["skipped_files"]
    assert skipped == {"corrupt": 2, "foreign": 1, "partial_write": 1}
    assert not list((key_dir / "records").glob(".*.tmp"))
    prompt = base + reply + _words(41, 10)
    warm = _run(again, prompt)
    assert warm[2].cached_tokens < 200 + MAX_TOKENS     # not from the truncated record
    _same(warm, _cold(model, prompt))
    again.close(5)


def test_a_record_whose_block_is_gone_is_never_loaded(tmp_path: Path) -> None:
    model = build_model("falcon_h1", seed=3)
    base = _words(50, 200)
    engine = _engine(model, tmp_path)
    _run(engine, base, (80,))
    _stop(engine)
    (key_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    for block in (key_dir / "blocks").iterdir():
        block.unlink()
    again = _engine(model, tmp_path)
    info = again.cache_info()["disk"]
    assert info["records"] == sum(1 for p in (key_dir / "records").iterdir()
                                  if not diskfmt.describe(p)[0]["blocks"])
    assert info["skipped_files"]["missing_block"] > 0
    prompt = base + _words(51, 10)
    _same(_run(again, prompt), _cold(model, prompt))
    again.close(5)


def test_another_model_never_sees_the_files(tmp_path: Path) -> None:
    base = _words(60, 150)
    a = _engine(build_model("qwen3", seed=3), tmp_path)
    _run(a, base)
    _stop(a)
    other = build_model("qwen3", seed=4)             # same shapes, other weights
    b = Engine(other, _config(), DiskSpec(tmp_path, "other-model", 1 << 30, 0.0, BLOCK))
    warm = _run(b, [*base, 1, 2, 3])
    assert warm[2].cached_tokens == 0 and b.cache_info()["disk"]["records"] == 0
    b.close(5)


def test_misses_name_their_reason(tmp_path: Path) -> None:
    model = build_model("qwen3_next", seed=3)
    one, two = _words(70, 300), _words(71, 1500)
    probe = Engine(model, _config())
    _run(probe, two)
    budget = probe.store.entries[0].nbytes * 13 // 10
    # RAM only: the first conversation is evicted by the second, then comes back
    ram_only = Engine(model, _config(cache_bytes=budget, checkpoint_interval=1024))
    reply = _run(ram_only, one)[0]
    _run(ram_only, two)
    back = _run(ram_only, one + reply + [5, 6])
    assert back[2].miss == "evicted" and back[2].known_tokens == 300 + MAX_TOKENS
    assert back[2].cached_tokens < back[2].known_tokens
    assert ram_only.cache_info()["misses"] == {"evicted": 1}
    # a turn larger than the whole RAM budget was never stored: the next one says so
    tiny = Engine(model, _config(cache_bytes=1000))
    reply = _run(tiny, one)[0]
    back = _run(tiny, one + reply + [5, 6])
    assert (back[2].miss, back[2].cached_tokens, back[2].known_tokens) == \
        ("not_stored", 0, 300 + MAX_TOKENS)
    # on disk, but the worker measured that reading it is slower than prefilling
    engine = _engine(model, tmp_path)
    reply = _run(engine, one)[0]
    _stop(engine)
    slow = _engine(model, tmp_path)
    slow.tiers.tiers.rates.prefill_tps, slow.tiers.tiers.rates.read_bps = 1e12, 1.0
    back = _run(slow, one + reply + [5, 6])
    assert (back[2].miss, back[2].cached_tokens, back[2].known_tokens) == \
        ("load_slower_than_prefill", 0, 300 + MAX_TOKENS)
    slow.close(5)


def test_sliding_window_edits_recompute_at_most_64_beyond_the_edit(tmp_path: Path) -> None:
    """A sliding-window model (window 128, one global layer in six), default checkpoint
    settings: an edit anywhere inside a long message restores within 64 tokens of the edit,
    from RAM and, after a restart, from disk (disk records keep RAM's granularity)."""
    from prefixd.backends.mlx.model.tiny import model_from_config, tiny_config

    config = tiny_config("gemma3_text")
    config.update(num_hidden_layers=6, sliding_window=128, sliding_window_pattern=6)
    model = model_from_config(config, seed=1)
    rng = random.Random(9)
    prompt = [rng.randrange(1, 1000) for _ in range(1600)]
    bounds = (300, 1000, 1600)
    spec = DiskSpec(tmp_path, "swa", 1 << 30, 0.0, 256)
    engine = Engine(model, EngineConfig(cache_bytes=1 << 30), spec)
    _run(engine, prompt, bounds)
    engine.persist()
    assert engine.close(30)
    cuts = [rng.randrange(310, 1590) for _ in range(8)]
    for label, make in (("ram", lambda: engine),
                        ("disk", lambda: Engine(model, EngineConfig(cache_bytes=1 << 30),
                                                spec))):
        for cut in cuts:
            target = make()
            edited = prompt[:cut] + _words(cut, 20)
            warm = _run(target, edited, tuple(b for b in bounds if b < cut))
            assert warm[2].tier == label
            assert 0 <= cut - warm[2].cached_tokens <= 64, (label, cut, warm[2].cached_tokens)
            if label == "ram":
                _run(target, prompt, bounds)        # back to the original conversation
            else:
                target.close(5)
    _same(warm, _cold(model, edited))


def test_record_prefixes_without_token_copies() -> None:
    """The index answers prefix questions from shared blocks + tails: the same answers as
    comparing whole token lists."""
    from prefixd.backends.mlx.disk import chain
    from prefixd.backends.mlx.disk import records as diskrec

    rng = random.Random(11)
    base = chain.as_tokens([rng.randrange(1, 50) for _ in range(700)])
    blocks: dict[str, diskrec.Block] = {}
    records = []
    for i in range(40):
        cut = rng.randrange(0, 700)
        toks = chain.as_tokens(list(base[:cut]) + [rng.randrange(1, 50) for _ in range(
            rng.randrange(0, 300))])
        if not len(toks):
            continue
        ids = chain.block_ids("salt", toks, BLOCK)
        for j, b in enumerate(ids):
            blocks.setdefault(b, diskrec.Block(0, toks[j * BLOCK:(j + 1) * BLOCK]))
        pos = rng.randrange(1, len(toks) + 1)           # a state inside the conversation
        used = min(len(ids), -(-pos // BLOCK))          # its last block possibly in part
        tail = toks[used * BLOCK:pos]
        records.append((toks[:pos], diskrec.Record(str(i), pos, tuple(ids[:used]), tail, 0,
                                                   False, 0.0)))
    for _ in range(40):
        prompt = chain.as_tokens(list(base[:rng.randrange(0, 700)]) +
                                 [rng.randrange(1, 50) for _ in range(rng.randrange(0, 200))])
        ids = chain.block_ids("salt", prompt, BLOCK)
        for toks, rec in records:
            assert diskrec.common_prefix(rec, prompt, ids, blocks, BLOCK) == \
                chain.common_prefix(toks, prompt)
    for toks_a, a in records:
        for toks_b, b in records:
            expected = len(toks_a) <= len(toks_b) and chain.common_prefix(
                toks_a, toks_b) == len(toks_a)
            assert diskrec.is_prefix(a, b, blocks, BLOCK) == expected


def test_idle_turns_write_each_kv_position_about_once(tmp_path: Path) -> None:
    """A conversation that goes idle after every turn (each turn written): every block is
    written once, and only states in the last, unfinished block carry their own KV tail, so
    the KV written beyond the conversation's own tokens is at most two tails per turn."""
    model = build_model("qwen3_5", seed=3)
    engine = _engine(model, tmp_path, delay=3600.0)
    prompt = _words(80, 300)
    turns = 6
    for t in range(turns):
        reply = _run(engine, prompt, (len(prompt) - 30,))[0]
        hand_over(engine, engine.lockstep, math.inf)       # idle: this turn is written
        assert engine.tiers.disk.drain(30.0)
        prompt = prompt + reply + _words(81 + t, 150)
    (key_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    tails = 0
    for path in (key_dir / "records").iterdir():
        _desc, f = diskfmt.describe(path)
        with f:
            tails += len(f.get_tensor("tokens"))
    info = engine.cache_info()["disk"]
    (entry,) = engine.store.entries
    assert info["written_blocks"] == len(entry.tokens) // BLOCK == info["blocks"]
    assert tails <= 2 * BLOCK * turns
    engine.close(5)


def test_one_worker_per_directory(tmp_path: Path) -> None:
    """A second engine (another worker of the same model) on a directory in use runs without
    a disk tier rather than fighting over its budget and index; it gets it once freed."""
    model = build_model("qwen3", seed=3)
    first = _engine(model, tmp_path)
    second = _engine(model, tmp_path)
    assert first.cache_info()["disk"] is not None and second.cache_info()["disk"] is None
    first.close(5)
    third = _engine(model, tmp_path)
    assert third.cache_info()["disk"] is not None
    third.close(5)


def test_quantized_kv_round_trips(tmp_path: Path) -> None:
    """`kv_bits=8`: the blocks hold the quantized triples; warm after a restart == cold."""
    from prefixd.backends.mlx.model.tiny import model_from_config, tiny_config

    config = tiny_config("qwen3")
    config.update(head_dim=64)                      # quantizable: groups of 32 or 64
    model = model_from_config(config, seed=3)
    base = _words(90, 300)
    first = _engine(model, tmp_path, kv_bits=8)
    assert first.cache_info()["kv_bits"] == 8
    reply = _run(first, base, BOUNDS)[0]
    _stop(first)
    again = _engine(model, tmp_path, kv_bits=8)
    prompt = base + reply + _words(91, 20)
    warm = _run(again, prompt)
    assert (warm[2].tier, warm[2].cached_tokens) == ("disk", 300 + MAX_TOKENS)
    # cold in the same chunks, as tests/test_checkpoints.py's quantized case: quantized
    # attention over differently split passes rounds differently (seen 2e-4 with OpenBLAS)
    _same(warm, _run(Engine(model, _config(cache_bytes=0, kv_bits=8)), prompt))
    again.close(5)


def test_a_chain_of_thousands_of_blocks_indexes(tmp_path: Path) -> None:
    """The start-up check walks block chains without recursion: 2,000 blocks of one prefix."""
    from prefixd.backends.mlx.disk.rebuild import open_tier
    from prefixd.backends.mlx.disk.writer import Job, State

    block, n = 16, 32_000
    tokens = np.arange(n, dtype=np.int32) % 997
    kv = {0: [np.zeros((1, 1, n, 4), np.float32), np.ones((1, 1, n, 4), np.float32)]}
    desc = {0: {"class": "KVCache", "n": 2, "quant": None}}
    tier = open_tier(tmp_path, "salt", ["KVCache"], 1 << 30, block)
    tier.submit(Job(tokens, kv, desc, {}, [State(n, {}, {}, {}, True)], "test"))
    assert tier.drain(60) and tier.close(5)
    again = open_tier(tmp_path, "salt", ["KVCache"], 1 << 30, block)
    assert (len(again.records), len(again.blocks), dict(again.skipped)) == (1, n // block, {})
    again.close(5)


def test_lookup_by_key_index_matches_a_full_scan(tmp_path: Path) -> None:
    """The disk lookup reads only the records keyed on the prompt's block chain; it must find
    what comparing the prompt with every record finds (records sharing a first block, trimmable
    or not, last blocks whole or in part)."""
    from prefixd.backends.mlx.disk import chain
    from prefixd.backends.mlx.disk import records as diskrec
    from prefixd.backends.mlx.disk.rebuild import open_tier

    block = 16
    tier = open_tier(tmp_path, "salt", ["KVCache"], 1 << 30, block)
    rng = random.Random(12)
    base = [rng.randrange(1, 20) for _ in range(400)]
    convs = []
    for i in range(30):
        cut = rng.randrange(block, 400)
        extra = [rng.randrange(1, 20) for _ in range(rng.randrange(0, 150))]
        toks = chain.as_tokens(base[:cut] + extra)
        ids = chain.block_ids("salt", toks, block)
        for j, b in enumerate(ids):
            tier.blocks.setdefault(b, diskrec.Block(0, toks[j * block:(j + 1) * block]))
        for k in range(3):
            pos = rng.randrange(1, len(toks) + 1)
            used = min(len(ids), -(-pos // block))
            rec = diskrec.Record(f"{i}-{k}", pos, tuple(ids[:used]), toks[used * block:pos],
                                 0, rng.random() < 0.3, float(i))
            tier.add_record(rec)
            convs.append((toks[:pos], rec))
    for _ in range(60):
        prompt = chain.as_tokens(base[:rng.randrange(block, 400)] +
                                 [rng.randrange(1, 20) for _ in range(rng.randrange(0, 100))])
        best = 0
        for toks, rec in convs:
            limit = min(chain.common_prefix(toks, prompt), len(prompt) - 1)
            best = max(best, rec.pos if rec.pos <= limit else (limit if rec.trimmable else 0))
        found = tier.lookup(prompt)
        assert (found[1] if found else 0) == best
    tier.close(1)


def test_states_written_to_disk_leave_memory(tmp_path: Path) -> None:
    """An entry the RAM budget evicts is written to disk and then held nowhere: memory stays
    within the RAM budget however many were written (before, the ledger of lost prefixes kept
    each evicted entry's write job, and with it every array of the entry)."""
    import gc

    import mlx.core as mx

    model = build_model("qwen3_5", seed=3)
    probe = Engine(model, _config())
    _run(probe, _words(40, 300), (100,))
    entry = probe.store.entries[0].nbytes
    engine = _engine(model, tmp_path, delay=3600.0, cache_bytes=entry * 13 // 10,
                     checkpoint_interval=1024)

    def settled() -> int:
        assert engine.tiers.disk.drain(30.0)
        gc.collect()
        return int(mx.get_active_memory())

    for i in range(2):
        _run(engine, _words(41 + i, 300), (100,))
    before = settled()
    for i in range(10):
        _run(engine, _words(50 + i, 300), (100,))
    written = engine.cache_info()["disk"]["written_records"]
    assert written >= 10
    assert settled() - before < entry, (before, written)
    engine.close(5)


def test_states_waiting_for_a_slow_disk_hold_at_most_a_quarter_of_the_ram_budget(
        tmp_path: Path) -> None:
    """Evicted states wait in memory until the writer has written them; where the disk falls
    behind (here: a writer that has not run yet), a state evicted while the waiting ones hold a
    quarter of the RAM budget is not written (`skipped_writes`; its prefix's miss says
    `not_on_disk`), so they cannot grow without bound. The waiting ones are written once the
    writer runs."""
    import gc

    import mlx.core as mx

    from prefixd.backends.mlx.disk.writer import DiskWriter

    model = build_model("qwen3_5", seed=3)
    probe = Engine(model, _config())
    _run(probe, _words(60, 300), (100,))
    entry = probe.store.entries[0].nbytes
    budget = entry * 13 // 10
    engine = _engine(model, tmp_path, delay=3600.0, cache_bytes=budget,
                     checkpoint_interval=1024)
    tier = engine.tiers.disk
    assert tier.drain(30.0)
    tier.writer = DiskWriter(tier)            # a disk that has not kept up: nothing written
    _run(engine, _words(61, 300), (100,))
    gc.collect()
    before = int(mx.get_active_memory())
    prompts = [_words(62 + i, 300) for i in range(10)]
    for p in prompts:
        _run(engine, p, (100,))
    gc.collect()
    info = engine.cache_info()["disk"]
    assert int(mx.get_active_memory()) - before < budget // 4 + 2 * entry
    assert info["skipped_writes"] >= 5, info
    tier.writer.start()
    assert tier.drain(30.0)
    info = engine.cache_info()["disk"]
    assert 1 <= info["written_records"] < 10 - 5 + 2, info
    reasons = {_run(engine, p + _words(90, 8))[2].miss for p in prompts[:-1]}
    assert "not_on_disk" in reasons, reasons
    engine.close(5)
