"""In-pass checkpoints (`engine/inpass/tap.py`): checkpoints inside a prefill pass, taken from the
pass itself, are the checkpoints a pass cut there gives; the prefill then takes as many passes
as stock mlx-lm however many checkpoints it holds; warm == cold from every one of them; a model
whose layers the hooks do not fit keeps cutting passes."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from test_checkpoints import (
    BOUNDS,
    CountingModel,
    _assert_same,
    _cold,
    _expected_restore,
    _run,
    _settings,
    _window,
    _words,
    append_only_turn,
)

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.engine import Engine
from prefixd.backends.mlx.engine.inpass import tap
from prefixd.backends.mlx.model.tiny import build_model, model_from_config

HYBRIDS = ("gemma3_text", "qwen3_next", "qwen3_5", "falcon_h1")  # the archs with snapshots


@pytest.fixture(scope="module", params=HYBRIDS)
def model(request: pytest.FixtureRequest) -> CountingModel:
    return CountingModel(build_model(request.param, seed=5))


def _values(leaf: Any) -> list[Any]:
    """What a leaf holds that decides every later output: a sliding window's offset and its
    last `max_size - 1` rows in temporal order (how many older rows the buffer still carries
    differs with the pass lengths and is trimmed by the next update), else the whole state."""
    if type(leaf) is RotatingKVCache:
        keys, values, offset, keep, max_size, _idx = leaf.state
        keys, values = leaf._temporal_order(keys), leaf._temporal_order(values)
        rows = min(offset, max_size - 1)
        return [offset, keep, np.array(keys[..., -rows:, :]), np.array(values[..., -rows:, :])]
    out: list[Any] = []

    def walk(x: Any) -> None:
        if isinstance(x, list | tuple):
            for v in x:
                walk(v)
        elif x is not None:
            out.append(np.array(x) if hasattr(x, "shape") else x)

    walk(leaf.state)
    return out


def test_checkpoints_inside_one_pass_equal_the_ones_cut_passes_take(model: CountingModel) -> None:
    rng = random.Random(31)
    prompt = _words(rng, 300)  # > the 128-token window: gemma3's window wraps inside the pass
    inpass = Engine(model, _settings(prefill_chunk=512))
    cut = Engine(model, _settings(prefill_chunk=512, checkpoint_inpass=False))
    assert inpass.inpass is not None and cut.inpass is None
    model.calls = 0
    _, _, s_in = _run(inpass, prompt, BOUNDS, max_tokens=1)
    _, _, s_cut = _run(cut, prompt, BOUNDS, max_tokens=1)
    (e_in,), (e_cut,) = inpass.store.entries, cut.store.entries
    assert sorted(e_in.checkpoints) == sorted(e_cut.checkpoints)
    assert len(e_in.checkpoints) >= 10
    # all but the tail, then the tail: as many passes as stock, however many checkpoints
    assert len(s_in.segments) == 2 and len(s_cut.segments) >= 10
    assert s_in.checkpoints == s_cut.checkpoints == len(e_in.checkpoints)
    for pos, c_in in e_in.checkpoints.items():
        c_cut = e_cut.checkpoints[pos]
        assert sorted(c_in.payload) == sorted(c_cut.payload)
        for i, leaf in c_in.payload.items():
            got, want = _values(leaf), _values(c_cut.payload[i])
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                if isinstance(w, np.ndarray):
                    assert g.shape == w.shape, (pos, i)
                    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
                else:
                    assert g == w, (pos, i)


@pytest.mark.parametrize("diverge", [20, 61, 100, 149, 199, 260, 297])
def test_warm_equals_cold_from_an_in_pass_checkpoint(model: CountingModel, diverge: int) -> None:
    rng = random.Random(32)
    base = _words(rng, 300)
    engine = Engine(model, _settings(prefill_chunk=512))
    _run(engine, base, BOUNDS)
    (entry,) = engine.store.entries
    prompt = entry.tokens[:diverge] + [t for t in _words(rng, 30)
                                       if t != entry.tokens[diverge]]
    warm = _run(engine, prompt)
    assert warm[2].cached_tokens == _expected_restore(entry.tokens, prompt, entry.trimmable,
                                                      _window(model))
    assert warm[2].cached_tokens > diverge - 16  # the interval (16) bounds what is recomputed
    _assert_same(warm, _cold(model, prompt))


def test_a_long_appended_message_takes_two_passes_and_keeps_its_interval_checkpoints(
        model: CountingModel) -> None:
    """The append-only turn of issue 18 with the default interval policy: a 260-token new
    message gets its interval checkpoints (an edit inside it later recomputes little) in the
    two passes stock takes."""
    engine = Engine(model, _settings(checkpoint_interval=64, prefill_chunk=512,
                                     checkpoint_tail=4))
    turn2, r, warm = append_only_turn(engine, random.Random(33), 200, (3, 120, 195), 260)
    n = len(turn2)
    assert warm[2].cached_tokens == r
    # all but the last token (its tail checkpoint inside the pass), then the last token, which
    # a decode pass carries when others decode (alone here: a pass of its own)
    assert [tokens for tokens, _ in warm[2].segments] == [n - 1 - r, 1]
    entry = max(engine.store.entries, key=lambda e: len(e.tokens))
    inside = [p for p in entry.checkpoints if r + 5 < p < n - 5]
    assert len(inside) >= 3          # every 64 tokens of the new message
    _assert_same(warm, _cold(model, turn2))
    edit = turn2[:inside[-1] + 7] + _words(random.Random(34), 20)
    again = _run(engine, edit)
    assert again[2].cached_tokens == inside[-1]
    _assert_same(again, _cold(model, edit))


def _tiny_mamba() -> Any:
    """Mamba (v1): recurrent layers with their own scan, which the hooks do not tap."""
    return model_from_config({
        "model_type": "mamba", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
        "state_size": 8, "num_hidden_layers": 2, "conv_kernel": 4, "use_bias": False,
        "use_conv_bias": True, "time_step_rank": 8, "tie_word_embeddings": True}, seed=1)


def test_a_model_the_hooks_do_not_fit_keeps_cutting_passes() -> None:
    model = CountingModel(_tiny_mamba())
    engine = Engine(model, _settings(prefill_chunk=512))
    indices = snapshot.snapshot_indices(make_prompt_cache(model))
    assert indices
    why = tap.verify(model, lambda: make_prompt_cache(model), indices)
    assert why is not None and "recurrence" in why
    assert engine.inpass is None
    prompt = _words(random.Random(35), 120)
    _, _, stats = _run(engine, prompt, (40, 90), max_tokens=1)
    (entry,) = engine.store.entries
    assert len(stats.segments) == len(entry.checkpoints)  # a pass ends at each checkpoint
    edit = prompt[:95] + _words(random.Random(36), 10)
    _assert_same(_run(engine, edit), _cold(model, edit))


def test_a_tap_that_fails_at_run_time_costs_checkpoints_not_answers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A recurrence the hook no longer sees at run time (as if a layer captured the function
    some other way): that pass loses its inner checkpoints, the answer stays exact, and the
    engine cuts passes from then on."""
    import mlx_lm.models.qwen3_next as qn

    model = CountingModel(build_model("qwen3_next", seed=5))
    engine = Engine(model, _settings(prefill_chunk=512))
    assert engine.inpass is not None
    monkeypatch.setattr(qn, "gated_delta_update", qn.gated_delta_update.__prefixd_original__)
    prompt = _words(random.Random(37), 200)
    first = _run(engine, prompt, BOUNDS[:1])
    assert engine.inpass is None and engine.fallbacks == {"inpass_error": 1}
    assert len(first[2].segments) == 2           # that pass was not cut...
    _assert_same(first, _cold(model, prompt))    # ...and its answer is exact
    second = _words(random.Random(38), 200)
    _, _, stats = _run(engine, second, BOUNDS[:1], max_tokens=1)
    entry = max(engine.store.entries, key=lambda e: e.last_used)
    assert len(stats.segments) == len(entry.checkpoints) >= 10   # a cut per checkpoint
