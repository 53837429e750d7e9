"""Warm == cold: restoring a cached prefix and replaying gives what a cold prefill gives.

For every tiny architecture (full attention, sliding window, Gated-DeltaNet, Mamba) the engine's
greedy tokens must be identical and its log-probabilities within LOGPROB_ATOL of a cold run of
the whole prompt (cold runs use a different prefill chunking, so float rounding differs), and
`cached_tokens` must equal the prompt tokens the model did not see (counted at its __call__).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.cache.placement import common_prefix, compute_interval, placement
from prefixd.backends.mlx.engine.engine import Engine, EngineConfig
from prefixd.backends.mlx.engine.stats import PromptStats
from prefixd.backends.mlx.model.tiny import ARCHS, build_model, model_from_config, tiny_config
from tests.engine_steps import generate, turn_for

LOGPROB_ATOL = 1e-4  # float32 tiny models; observed up to 2.3e-5 (gemma3_text), ~2e-6 others
MAX_TOKENS = 4
BOUNDS = (60, 150, 220)


class CountingModel:
    """The real model, with a count of the tokens each forward pass runs (an observer)."""

    def __init__(self, model: Any, make_cache: Any = None) -> None:
        self.model = model
        self.tokens = 0
        self.calls = 0
        if make_cache is not None:
            self.make_cache = make_cache

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        self.tokens += inputs.shape[1]
        self.calls += 1
        return self.model(inputs, cache=cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _settings(**kw: Any) -> EngineConfig:
    base = {"checkpoint_interval": 16, "prefill_chunk": 16, "checkpoint_tail": 2}
    return EngineConfig(**{**base, **kw})


def _run(engine: Engine, prompt: list[int], bounds: Sequence[int] = (),
         max_tokens: int = MAX_TOKENS) -> tuple[list[int], list[np.ndarray], PromptStats]:
    logprobs: list[np.ndarray] = []

    def greedy(lp: mx.array) -> mx.array:
        logprobs.append(np.array(lp.astype(mx.float32)))
        return mx.argmax(lp, axis=-1)

    turn = turn_for(engine)
    tokens = list(generate(engine, prompt, sampler=greedy, max_tokens=max_tokens,
                           boundaries=bounds, turn=turn))
    assert turn.stats is not None
    return tokens, logprobs, turn.stats


def _assert_same(warm: tuple, cold: tuple) -> None:
    assert warm[0] == cold[0]
    for w, c in zip(warm[1], cold[1], strict=True):
        np.testing.assert_allclose(w, c, atol=LOGPROB_ATOL, rtol=0)


@pytest.fixture(scope="module", params=ARCHS)
def model(request: pytest.FixtureRequest) -> CountingModel:
    return CountingModel(build_model(request.param, seed=3))


def _cold(model: Any, prompt: list[int], **kw: Any) -> tuple:
    return _run(Engine(model, _settings(cache_bytes=0, prefill_chunk=512, **kw)), prompt)


def _words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 1000) for _ in range(n)]


def _window(model: Any) -> int:
    """The smallest sliding window of the model's layers (0 if it has none)."""
    sizes = [c.max_size for c in snapshot.leaves(make_prompt_cache(model))
             if type(c) is RotatingKVCache]
    return min(sizes, default=0)


def _expected_restore(entry_tokens: list[int], prompt: list[int], trimmable: bool,
                      window: int = 0) -> int:
    """The spec: the largest checkpoint <= min(LCP, len(prompt) - 1) (any position if trimmable,
    the entry's end if the prompt extends it); a checkpoint taken before the sliding window
    wrapped (position < window) is trimmed down to that limit."""
    limit = min(common_prefix(entry_tokens, prompt), len(prompt) - 1)
    if trimmable or len(entry_tokens) <= limit:
        return min(limit, len(entry_tokens))
    marks = placement(300, 0, BOUNDS, 16, 2)
    if any(limit < p < window for p in marks):
        return limit
    return max([p for p in marks if p <= limit], default=0)


@pytest.mark.parametrize("diverge", [5, 16, 17, 59, 60, 61, 150, 151, 230, 298, 299, 300, "gen"])
def test_warm_equals_cold_around_checkpoints(model: CountingModel, diverge: int | str) -> None:
    rng = random.Random(7)
    base = _words(rng, 300)  # > the 128-token sliding window: gemma3 wraps
    engine = Engine(model, _settings())
    _run(engine, base, BOUNDS)
    (entry,) = engine.store.entries
    cut = len(entry.tokens) if diverge == "gen" else int(diverge)
    prompt = entry.tokens[:cut] + [t for t in _words(rng, 41) if t not in entry.tokens[cut:cut + 1]]
    model.tokens = 0
    warm = _run(engine, prompt)
    stats = warm[2]
    assert stats.cached_tokens == _expected_restore(entry.tokens, prompt, entry.trimmable,
                                                    _window(model))
    assert stats.cached_tokens + stats.recomputed_tokens == len(prompt)
    # every generated token is fed back, the last one after the generation ends
    assert model.tokens == len(prompt) - stats.cached_tokens + MAX_TOKENS
    _assert_same(warm, _cold(model, prompt))


def test_exact_repeat_and_shorter_prompt(model: CountingModel) -> None:
    rng = random.Random(8)
    base = _words(rng, 300)
    engine = Engine(model, _settings())
    first = _run(engine, base, BOUNDS)
    for prompt in (base, base[:200], base[:61], base):
        warm = _run(engine, prompt, BOUNDS)
        assert 0 < warm[2].cached_tokens < len(prompt)
        _assert_same(warm, _cold(model, prompt))
    _assert_same(_run(engine, base), first)


def test_snapshot_restored_twice_matches_cold_both_times(model: CountingModel) -> None:
    rng = random.Random(9)
    base = _words(rng, 300)
    engine = Engine(model, _settings())
    _run(engine, base, BOUNDS)
    prompts = [base[:150] + _words(rng, 30) for _ in range(2)]
    for prompt in [*prompts, *prompts]:
        warm = _run(engine, prompt)
        assert warm[2].cached_tokens >= 144
        _assert_same(warm, _cold(model, prompt))


def _leaf_values(snap: dict[int, Any]) -> list[Any]:
    return [(c.offset, c._idx, np.array(c.keys), np.array(c.values)) for c in snap.values()]


def test_unwrapped_window_checkpoint_is_trimmed_to_a_shorter_prefix() -> None:
    """Stock mlx-lm trims an unwrapped RotatingKVCache; so does prefixd, with warm == cold."""
    model = CountingModel(build_model("gemma3_text", seed=3))
    rng = random.Random(18)
    base = _words(rng, 300)  # wraps the 128-token window; its checkpoint at 100 does not
    engine = Engine(model, _settings(checkpoint_interval=256))
    _run(engine, base, (100,))
    (entry,) = engine.store.entries
    ckpt = entry.checkpoints[100]
    assert ckpt.trimmable and not entry.trimmable
    assert not any(c.trimmable for p, c in entry.checkpoints.items() if p >= 128)
    before = _leaf_values(ckpt.payload)
    for shared in (7, 60, 99, 120):  # 120: above the checkpoint, restored exactly at 100
        prompt = base[:shared] + [t for t in _words(rng, 30) if t != base[shared]]
        model.tokens = 0
        warm = _run(engine, prompt)
        assert warm[2].cached_tokens == min(shared, 100)
        assert model.tokens == len(prompt) - warm[2].cached_tokens + MAX_TOKENS
        _assert_same(warm, _cold(model, prompt))
    # a restore holds buffers of exactly the restored tokens, not the long entry's
    restored = snapshot.restore(entry.payload, ckpt.payload, 7)
    assert {c.keys.shape[2] for c in snapshot.leaves(restored)} == {7}
    assert snapshot.nbytes(restored) * 30 < snapshot.nbytes(entry.payload)
    # restores trim copies: the stored snapshot is unchanged (snapshots are values)
    for (o1, i1, k1, v1), (o2, i2, k2, v2) in zip(before, _leaf_values(ckpt.payload),
                                                  strict=True):
        assert (o1, i1) == (o2, i2) == (100, 100)
        np.testing.assert_array_equal(k1, k2)
        np.testing.assert_array_equal(v1, v2)


@pytest.mark.parametrize("arch", ["qwen3_next", "falcon_h1"])
def test_recurrent_checkpoints_are_never_trimmed(arch: str) -> None:
    model = CountingModel(build_model(arch, seed=3))
    rng = random.Random(19)
    base = _words(rng, 300)
    engine = Engine(model, _settings(checkpoint_interval=256))
    _run(engine, base, (100,))
    (entry,) = engine.store.entries
    assert sorted(entry.checkpoints) == [100, 298, 300]  # boundary, tail mark, end
    assert not any(c.trimmable for c in entry.checkpoints.values())
    for shared, expected in ((7, None), (99, None), (150, 100), (298, 298)):
        prompt = base[:shared] + [t for t in _words(rng, 10) if t != base[shared]]
        m = engine.store.lookup(prompt)
        got = None if m is None else (m.pos, m.checkpoint and m.checkpoint.pos)
        assert got == (None if expected is None else (expected, expected))
    prompt = base[:150] + _words(rng, 10)
    warm = _run(engine, prompt)
    assert warm[2].cached_tokens == 100
    _assert_same(warm, _cold(model, prompt))


def test_multi_turn_with_edit_in_earlier_message(model: CountingModel) -> None:
    rng = random.Random(10)
    system, user1 = _words(rng, 70), _words(rng, 90)
    engine = Engine(model, _settings())
    turn1 = system + user1
    reply, _, _ = _run(engine, turn1, (70,), max_tokens=8)
    turn2 = turn1 + reply + _words(rng, 60)
    warm = _run(engine, turn2, (70, 160, 168))
    assert warm[2].cached_tokens == 160 + 8  # the prompt and all 8 generated tokens
    _assert_same(warm, _cold(model, turn2))
    edited = [*turn2[:110], 999, *turn2[111:]]  # a typo fixed inside the first user message
    warm = _run(engine, edited, (70, 160, 168))
    assert 70 <= warm[2].cached_tokens <= 110
    _assert_same(warm, _cold(model, edited))


def test_stopped_or_closed_generation_commits_what_the_kv_holds(model: CountingModel) -> None:
    rng = random.Random(11)
    prompt = _words(rng, 200)
    engine = Engine(model, _settings())
    chunks = iter(range(3))
    assert list(generate(engine, prompt, sampler=lambda lp: mx.argmax(lp, axis=-1), max_tokens=4,
                                should_stop=lambda: next(chunks, None) is None)) == []
    assert [len(e.tokens) for e in engine.store.entries] == [48]
    gen = generate(engine, prompt, sampler=lambda lp: mx.argmax(lp, axis=-1), max_tokens=50)
    assert engine.store.entries[0].tokens == prompt[:48]
    got = [next(gen), next(gen)]
    gen.close()  # e.g. a stop string: both tokens are fed, the last one on close
    assert engine.store.entries[0].tokens == prompt + got
    warm = _run(engine, [*prompt, *got, 5])
    assert warm[2].cached_tokens == 202
    _assert_same(warm, _cold(model, [*prompt, *got, 5]))
    # should_stop() (the client went away) ends it without feeding the last token
    stop = False
    gen = generate(engine, prompt, sampler=lambda lp: mx.argmax(lp, axis=-1), max_tokens=50,
                          should_stop=lambda: stop)
    got = [next(gen), next(gen)]
    stop = True
    assert list(gen) == []
    assert engine.store.entries[-1].tokens == prompt + got[:1]


def test_stored_entry_covers_prompt_and_every_generated_token(model: CountingModel) -> None:
    rng = random.Random(16)
    prompt = _words(rng, 37)
    engine = Engine(model, _settings())
    reply, _, _ = _run(engine, prompt, max_tokens=8)
    assert [e.tokens for e in engine.store.entries] == [prompt + reply]
    model.tokens = 0
    nxt = prompt + reply + _words(rng, 9)
    warm = _run(engine, nxt)
    assert warm[2].cached_tokens == 45 and model.tokens == 9 + MAX_TOKENS
    _assert_same(warm, _cold(model, nxt))
    # an exact repeat recomputes one token where the entry trims back to len - 1, else the
    # tail (2 tokens, in the one pass from the tail mark)
    (entry,) = engine.store.entries
    for p in (nxt, nxt):
        assert _run(engine, p)[2].recomputed_tokens == (1 if entry.trimmable else 2)


def test_a_stored_entry_holds_its_positions_not_the_padded_buffer(model: CountingModel) -> None:
    """mlx-lm grows KV buffers 256 positions at a time: a 64-token conversation is stored (and
    budgeted) with 64 positions per KV buffer, not 256, and a later turn restored from it still
    equals a cold run."""
    rng = random.Random(17)
    prompt = _words(rng, 60)
    engine = Engine(model, _settings())
    reply = _run(engine, prompt)[0]
    (entry,) = engine.store.entries
    positional = [leaf for leaf in snapshot.leaves(entry.payload)
                  if type(leaf) in (KVCache, RotatingKVCache)]
    assert positional
    for leaf in positional:
        assert leaf.offset == len(prompt) + MAX_TOKENS
        assert leaf.keys.shape[-2] == leaf.values.shape[-2] == leaf.offset
    assert entry.nbytes == snapshot.nbytes(entry.payload)
    nxt = prompt + reply + _words(rng, 300)          # grows past the stored buffer
    _assert_same(_run(engine, nxt), _cold(model, nxt))


def test_unknown_cache_class_falls_back_to_cold() -> None:
    class OddKVCache(KVCache):
        """A KV cache class prefixd has not verified."""

    base = build_model("qwen3", seed=3)
    odd = CountingModel(base, make_cache=lambda: [OddKVCache() for _ in base.layers])
    engine = Engine(odd, _settings())
    prompt = _words(random.Random(12), 80)
    _run(engine, prompt)
    warm = _run(engine, prompt)
    assert (warm[2].fallback, warm[2].cached_tokens) == ("unsupported_cache", 0)
    assert engine.cache_info()["fallbacks"] == {"unsupported_cache": 2}
    _assert_same(warm, _cold(CountingModel(base), prompt))


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_kv_quantization_warm_equals_cold(arch: str) -> None:
    # head_dim 64 so mx.quantize's group size fits; gemma3's sliding layers stay unquantized.
    model = model_from_config({**tiny_config(arch), "head_dim": 64, "query_pre_attn_scalar": 64}
                              if arch == "gemma3_text" else {**tiny_config(arch), "head_dim": 64},
                              seed=3)
    # Passes cut at the checkpoints, so the warm run's history and the cold run are computed in
    # the same chunks: quantizing turns the last-bit differences of other chunkings (in-pass
    # checkpoints do not cut) into ~1e-3 (OpenBLAS), above this comparison's tolerance.
    engine = Engine(model, _settings(kv_bits=8, checkpoint_inpass=False))
    assert engine.cache_info()["kv_bits"] == 8
    rng = random.Random(13)
    base = _words(rng, 260)
    _run(engine, base, BOUNDS)
    prompt = base[:150] + _words(rng, 40)
    warm = _run(engine, prompt)
    assert warm[2].cached_tokens >= 148
    _assert_same(warm, _run(Engine(model, _settings(kv_bits=8, cache_bytes=0,
                                                    checkpoint_inpass=False)), prompt))


def test_kv_quantization_unsupported_head_dim_keeps_full_precision() -> None:
    engine = Engine(build_model("gemma3_text", seed=3), _settings(kv_bits=4))
    info = engine.cache_info()
    assert info["kv_bits"] is None and info["fallbacks"] == {"kv_quant_unsupported": 1}


def test_small_budget_is_never_exceeded_and_answers_stay_exact(model: CountingModel) -> None:
    rng = random.Random(14)
    budget = 120_000
    engine = Engine(model, _settings(cache_bytes=budget))
    convs = [_words(rng, 120) for _ in range(3)]
    for turn in range(3):
        for c in convs:
            prompt = c + [7 + turn] * 5
            warm = _run(engine, prompt, (120,))
            assert engine.store.bytes_used <= budget
            if turn == 2:
                _assert_same(warm, _cold(model, prompt))
    assert engine.cache_info()["bytes_used"] <= budget


def test_metrics_and_cache_info_report_hits() -> None:
    from prefixd.metrics import REGISTRY

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    cached0 = sample("prefixd_worker_cached_tokens_total")
    engine = Engine(build_model("qwen3_next", seed=3), _settings())
    prompt = _words(random.Random(15), 100)
    _run(engine, prompt, (40,))
    stats = _run(engine, [*prompt[:90], 5, 6, 7])[2]
    info = engine.cache_info()
    assert info["hit_tokens_total"] == stats.cached_tokens > 0
    assert sample("prefixd_worker_cached_tokens_total") - cached0 == info["hit_tokens_total"]
    assert sample("prefixd_worker_cache_bytes", kind="checkpoint") > 0
    assert info["bytes_used"] <= info["bytes_budget"] and info["checkpoints"] > 0


@pytest.mark.parametrize("arch", ["qwen3_next", "gemma3_text"])
def test_auto_interval_is_sized_from_the_checkpoint_bytes(
        arch: str, caplog: pytest.LogCaptureFixture) -> None:
    model = build_model(arch, seed=3)
    with caplog.at_level(logging.INFO, logger="prefixd.worker.cache"):
        engine = Engine(model, _settings(checkpoint_interval=None))
    info = engine.cache_info()
    estimate, auto = info["checkpoint_bytes_estimate"], info["checkpoint_interval_auto"]
    assert auto["by_bytes"] == 64 and estimate > 0  # tiny model, 4 GiB
    # ... and the interval whose extra forward passes cost at most 2% of the prefill, which
    # depends on the machine (a tiny model's pass is mostly fixed cost)
    assert auto["by_compute"] == compute_interval(auto["pass_ms"], auto["token_ms"])
    interval = info["checkpoint_interval"]
    assert interval == 64                     # the default policy sizes by bytes alone
    assert f"checkpoint interval {interval} tokens" in caplog.text
    # "cost" bounds the extra passes that checkpoints cut, so it binds only for a model whose
    # checkpoints cannot be taken inside passes
    by_cost = Engine(model, _settings(checkpoint_interval=None, checkpoint_inpass=False,
                                      checkpoint_interval_policy="cost"))
    assert by_cost.cache_info()["checkpoint_interval"] == max(
        64, by_cost.cache_info()["checkpoint_interval_auto"]["by_compute"])
    inpass_cost = Engine(model, _settings(checkpoint_interval=None,
                                          checkpoint_interval_policy="cost"))
    assert inpass_cost.inpass and inpass_cost.cache_info()["checkpoint_interval"] == 64
    _run(engine, _words(random.Random(17), 300), (100,))
    (entry,) = engine.store.entries
    assert sorted(entry.checkpoints) == placement(300, 0, (100,), interval, 2,
                                                  trim_below=_window(model))
    assert max(c.nbytes for c in entry.checkpoints.values()) <= estimate
    # A budget that holds a handful of checkpoints gets the widest interval.
    tight = Engine(model, _settings(checkpoint_interval=None, cache_bytes=estimate * 16))
    assert tight.cache_info()["checkpoint_interval"] == 4096
    assert Engine(model, _settings()).cache_info()["checkpoint_interval"] == 16  # explicit


def test_a_failing_commit_costs_the_cache_entry_not_the_reply(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The cache is stored after the reply was sent: if storing raises, the reply stands, the
    entry is dropped (not left in progress for good) and the failure is logged and counted."""
    model = build_model("qwen3", seed=3)
    engine = Engine(model, _settings())
    prompt = _words(random.Random(20), 40)
    cold = _run(Engine(model, _settings(cache_bytes=0)), prompt)

    def broken(self: Any) -> int:
        raise RuntimeError("nbytes failed")

    # The outermost boundary: mlx-lm's own cache class, as if measuring its size failed.
    monkeypatch.setattr(KVCache, "nbytes", property(broken))
    with caplog.at_level(logging.ERROR, logger="prefixd.worker.cache"):
        reply = _run(engine, prompt)  # the generator closes (and commits) without raising
    _assert_same(reply, cold)
    assert engine.store.entries == [] and engine.store.bytes_used == 0
    assert engine.cache_info()["fallbacks"] == {"commit_error": 1}
    assert "storing this request's prompt cache failed" in caplog.text
    monkeypatch.undo()
    _run(engine, prompt)  # the next request caches again
    assert [len(e.tokens) for e in engine.store.entries] == [len(prompt) + MAX_TOKENS]


def test_stats_account_for_every_pass_and_checkpoint(model: CountingModel) -> None:
    engine = Engine(model, _settings())
    prompt = _words(random.Random(21), 150)
    model.tokens = model.calls = 0
    stats = _run(engine, prompt, BOUNDS[:1], max_tokens=1)[2]
    (entry,) = engine.store.entries
    # max_tokens=1: no decode pass; the one generated token is fed at the end
    assert len(stats.segments) == model.calls - 1
    assert sum(n for n, _ in stats.segments) == stats.recomputed_tokens == model.tokens - 1 == 150
    assert stats.checkpoints == len(entry.checkpoints)
    assert stats.checkpoint_bytes == sum(c.nbytes for c in entry.checkpoints.values())
    assert all(v >= 0 for v in stats.seconds().values())


def append_only_turn(engine: Engine, rng: random.Random, first: int, bounds: tuple[int, ...],
                     new: int) -> tuple[list[int], int, tuple]:
    """Turn 1 (`first` tokens, message boundaries `bounds`) and its 8-token reply, then turn 2
    appending a `new`-token message (boundaries: its content start and end, as the worker
    gives them): (turn 2's tokens, what turn 1 stored, turn 2's run)."""
    turn1 = _words(rng, first)
    reply, _, _ = _run(engine, turn1, bounds, max_tokens=8)
    r = len(turn1) + len(reply)
    turn2 = [*turn1, *reply, *_words(rng, new)]
    return turn2, r, _run(engine, turn2, (*bounds[:2], r + 5, len(turn2) - 5))


def test_an_append_only_turn_takes_two_prefill_passes_like_stock(model: CountingModel) -> None:
    """Checkpoints for free: the next turn restores the previous prompt + reply and prefills
    the rest in two passes (as stock mlx-lm): all but the last token, then the last token
    (which rides a decode pass when others decode), taking its checkpoints where the passes
    end anyway (the prompt's end) or inside them (the last message's end, in-pass); where
    checkpoints cannot be taken inside a pass, all but the tail, then the tail. An all-KV
    model takes no checkpoints."""
    engine = Engine(model, _settings(checkpoint_interval=512, prefill_chunk=512,
                                     checkpoint_tail=4))
    turn2, r, warm = append_only_turn(engine, random.Random(22), 160, (3, 73, 155), 105)
    n = len(turn2)
    stats = warm[2]
    assert stats.cached_tokens == r
    last_token = not snapshot.snapshot_indices(make_prompt_cache(model)) or engine.inpass
    assert [tokens for tokens, _ in stats.segments] == ([n - 1 - r, 1] if last_token
                                                         else [n - 5 - r, 5])
    (entry,) = engine.store.entries
    if not entry.trimmable:  # the tail mark and the end are checkpoints, nothing in between
        assert [p for p in entry.checkpoints if p > r] == [n - 5, n]
    _assert_same(warm, _cold(model, turn2))


def test_a_shared_snapshot_keeps_its_values_while_the_live_cache_decodes() -> None:
    """Snapshots share the live cache's arrays (no copy); the sliding window's single-token
    updates then write into that shared buffer in place, which copies it first (MLX copy on
    write), so the snapshot keeps its values."""
    model = build_model("gemma3_text", seed=3)
    cache = make_prompt_cache(model)
    model(mx.array([_words(random.Random(23), 200)]), cache=cache)
    model(mx.array([[4]]), cache=cache)  # the window buffer is now max_size, written in place
    snapshot.evaluate(cache)
    snap, _ = snapshot.take(cache, snapshot.snapshot_indices(cache))
    before = _leaf_values(snap)
    buffers = [c.keys for c in snap.values()]
    for token in (5, 6, 7):
        model(mx.array([[token]]), cache=cache)
        snapshot.evaluate(cache)
    live = [snapshot.leaves(cache)[i] for i in snap]
    assert all(c.offset == 204 and c.keys.shape[2] == c.max_size for c in live)
    assert all(c.keys is not b for c, b in zip(live, buffers, strict=True))
    for (o1, i1, k1, v1), (o2, i2, k2, v2) in zip(before, _leaf_values(snap), strict=True):
        assert (o1, i1) == (o2, i2) and o1 == 201
        np.testing.assert_array_equal(k1, k2)
        np.testing.assert_array_equal(v1, v2)
