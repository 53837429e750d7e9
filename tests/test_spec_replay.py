"""Verify passes that keep no state per drafted position (`engine/inpass/captured.py`, `Replay`): on
a model whose recurrent state is large, a verify pass computes the state at the accepted
position again from the pass's own inputs instead of holding one state per drafted token.
Replies stay those of decoding without drafts, replies closed among accepted tokens leave
exactly their tokens cached, and the memory a speculating request holds between its passes is
about one state, not one per draft."""

from __future__ import annotations

import gc
import random
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.config import EngineConfig
from prefixd.backends.mlx.engine.engine import Engine
from prefixd.backends.mlx.model.tiny import (
    build_model,
    model_from_config,
    restrict_output,
    tiny_config,
)
from tests.engine_steps import generate, turn_for

ALPHABET = [5, 6, 7, 8]
REPLAY_ARCHS = ["qwen3_next", "mamba2", "olmo_hybrid", "falcon_h1", "jamba"]


def _greedy(lp: mx.array) -> mx.array:
    return mx.argmax(lp, axis=-1)


def _engines(model: Any, capture_bytes: int, **config: Any) -> tuple[Engine, Engine]:
    """With and without speculation; drafts sized by fixed costs (the same on any machine)."""
    return _speculating(model, capture_bytes, **config), _plain(model, **config)


def _speculating(model: Any, capture_bytes: int, **config: Any) -> Engine:
    spec = Engine(model, EngineConfig(cache_bytes=1 << 28, spec_capture_bytes=capture_bytes,
                                      **config))
    assert spec.spec is not None, spec.unspeculative
    spec.spec.costs.timed = False
    spec.spec.costs.seconds = {n: 0.01 for n in range(1, 256)}
    return spec


def _plain(model: Any, **config: Any) -> Engine:
    return Engine(model, EngineConfig(cache_bytes=1 << 28, speculative=False, **config))


@pytest.mark.parametrize("arch", REPLAY_ARCHS)
def test_replayed_states_reply_and_cache_as_decoding_without_drafts(arch: str) -> None:
    model = build_model(arch)
    restrict_output(model, ALPHABET)
    spec, plain = _engines(model, 0)
    rng = random.Random(7)
    replayed = rejected = 0
    for n in (30, 70):
        prompt = [rng.choice(ALPHABET) for _ in range(n)]
        turn = turn_for(spec)
        got = []
        for token in generate(spec, prompt, sampler=_greedy, max_tokens=60, turn=turn):
            got.append(token)
            assert turn.run is not None and turn.run.spec is not None
            captured = turn.run.spec.captured
            replayed += bool(captured is not None and captured.replayed)
        assert got == list(generate(plain, prompt, sampler=_greedy, max_tokens=60)), arch
        assert turn.stats is not None and turn.stats.speculative is not None
        rejected += turn.stats.speculative["drafted"] > turn.stats.speculative["accepted"]
    assert replayed and rejected
    # replies cut at every length (some among accepted tokens): exactly their tokens cached
    base = [rng.choice(ALPHABET) for _ in range(40)]
    for max_tokens in range(2, 12):
        prompt = [*base, max_tokens]
        reply = list(generate(spec, prompt, sampler=_greedy, max_tokens=max_tokens))
        follow = [*prompt, *reply, 5, 6]
        assert spec.cached_now(follow) == len(prompt) + len(reply), (arch, max_tokens)
        if reply == list(generate(plain, prompt, sampler=_greedy, max_tokens=max_tokens)):
            # the recurrent states it stored are those one-token passes leave
            for got_state, want in zip(_states(spec, [*prompt, *reply]),
                                       _states(plain, [*prompt, *reply]), strict=True):
                scale = float(mx.abs(want).max()) + 1e-6
                assert float(mx.abs(got_state - want).max()) <= 1e-3 * scale, arch
        warm = list(generate(spec, follow, sampler=_greedy, max_tokens=10))
        assert warm == list(generate(plain, follow, sampler=_greedy, max_tokens=10)), arch


def _states(engine: Engine, tokens: list[int]) -> list[mx.array]:
    """The recurrent states (and convolution inputs) stored at the end of `tokens`."""
    entry = next(e for e in engine.store.entries if e.tokens == tokens and not e.in_progress)
    return [a for leaf in snapshot.leaves(entry.payload) if type(leaf) is ArraysCache
            for a in leaf.cache]


def _held_between_steps(engine: Engine, prompt: list[int]) -> tuple[int, int]:
    """The most MLX memory held between two decode steps past what it held at the first
    token, and the number of those steps."""
    steps = generate(engine, prompt, sampler=_greedy, max_tokens=40)
    next(steps)
    gc.collect()
    base, held, n = mx.get_active_memory(), 0, 0
    for _ in steps:
        held, n = max(held, mx.get_active_memory() - base), n + 1
    return held, n


def test_a_large_states_verify_holds_about_one_state_not_one_per_draft() -> None:
    """A hybrid whose Gated-DeltaNet state dwarfs the rest (3 layers of 16 x 64 x 64 float32
    per request): held between steps, speculation without replay keeps a state per drafted
    position (the test can tell), with replay about the state before the last pass."""
    model = model_from_config({**tiny_config("qwen3_next"), "linear_num_value_heads": 16,
                               "linear_num_key_heads": 8, "linear_key_head_dim": 64,
                               "linear_value_head_dim": 64})
    restrict_output(model, ALPHABET)
    state = 3 * 16 * 64 * 64 * 4
    prompt = [random.Random(3).choice(ALPHABET) for _ in range(20)] * 3
    # the interval the engine picks for this model anyway (by bytes: 0.82 MiB checkpoints in
    # 256 MiB), set rather than probed: the probe's timed passes cost ~1 s an engine
    fixed = {"checkpoint_interval": 512}
    kept = _speculating(model, 1 << 40, **fixed)
    replay, plain = _engines(model, 0, **fixed)
    held_plain, _ = _held_between_steps(plain, prompt)
    held_kept, _ = _held_between_steps(kept, prompt)
    held_replay, n = _held_between_steps(replay, prompt)
    assert n
    assert held_kept - held_plain >= 4 * state
    assert held_replay - held_plain <= 2.5 * state


def test_a_verify_pass_whose_tap_fails_feeds_the_accepted_tokens_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A recurrence the hook no longer sees at run time: the verify pass captures nothing, the
    recurrent leaves go back to their state before it, and the accepted tokens are fed again;
    the reply and the next turn stay those of decoding without drafts."""
    import mlx_lm.models.qwen3_next as qn

    model = build_model("qwen3_next")
    restrict_output(model, ALPHABET)
    spec, plain = _engines(model, 1 << 40)
    prompt = [random.Random(13).choice(ALPHABET) for _ in range(30)]
    turn = turn_for(spec)
    steps = generate(spec, prompt, sampler=_greedy, max_tokens=50, turn=turn)
    got = [next(steps)]
    monkeypatch.setattr(qn, "gated_delta_update", qn.gated_delta_update.__prefixd_original__)
    got += list(steps)
    assert got == list(generate(plain, prompt, sampler=_greedy, max_tokens=50))
    assert turn.stats is not None and turn.stats.speculative is not None
    assert turn.stats.speculative["drafted"] > turn.stats.speculative["accepted"] > 0
    follow = [*prompt, *got, 5, 6]
    assert spec.cached_now(follow) == len(prompt) + len(got)
    warm = list(generate(spec, follow, sampler=_greedy, max_tokens=10))
    assert warm == list(generate(plain, follow, sampler=_greedy, max_tokens=10))
