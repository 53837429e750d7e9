"""Drafters checked at load (issue 47, item 3): a model's MTP head or a draft model whose
weights are not all finite, whose head file does not fit, whose tokenizer names other tokens
by the same ids (however many it has) or ends sequences on another token, or that does not
load at all, is refused: named with why in the worker's log (a warning) and in `/v1/cache`
(`speculative.refused`), and the worker serves without it, prompt lookup still drafting.
Drafting stays exact either way; a damaged drafter only wasted time before (its every draft
rejected).

Real workers (`Generator`) on tiny models whose folders are damaged one way each; a sound copy
of the same drafter is used, so a check that refused too much would fail too."""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from aiohttp.test_utils import TestClient, TestServer

from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.model import tinytok
from prefixd.backends.mlx.model.mtp import MTP_FILE
from prefixd.backends.mlx.model.tiny import save_tiny_model
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.scheduler.jobs import Finished
from prefixd.backends.mlx.server.app import create_app
from prefixd.backends.mlx.settings import WorkerSettings
from tests.worker_fixtures import collect, untimed

GREEDY = Sampling(temperature=0)
Weights = dict[str, mx.array]


# --- damaging a model folder ---------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(file: Path, change: Callable[[Weights], Weights]) -> None:
    """`file`'s tensors changed by `change` (its metadata kept)."""
    weights, metadata = mx.load(str(file), return_metadata=True)
    assert isinstance(weights, dict)
    mx.save_safetensors(str(file), change(dict(weights)), metadata=metadata)


def _set_one(name: str, value: float) -> Callable[[Weights], Weights]:
    """One element of tensor `name` set to `value`."""
    def change(w: Weights) -> Weights:
        flat = w[name].reshape(-1)
        flat[3] = value
        return {**w, name: flat.reshape(w[name].shape)}
    return change


def _all_nan(w: Weights) -> Weights:
    return {k: mx.full(v.shape, float("nan"), dtype=v.dtype) for k, v in w.items()}


def _without(name: str) -> Callable[[Weights], Weights]:
    return lambda w: {k: v for k, v in w.items() if k != name}


def _transposed(name: str) -> Callable[[Weights], Weights]:
    return lambda w: {**w, name: w[name].T}


def _swap_tokens(folder: Path, a: str, b: str) -> None:
    """Tokens `a` and `b` trade ids in `folder`'s tokenizer: as many tokens, the same
    strings, two ids naming each other's token."""
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(spec))


def _ends_on(folder: Path, token: str) -> None:
    """`folder`'s model and tokenizer end a sequence on `token`."""
    tokenizer_config = folder / "tokenizer_config.json"
    spec = json.loads(tokenizer_config.read_text())
    spec["eos_token"] = token
    tokenizer_config.write_text(json.dumps(spec))
    config = folder / "config.json"
    spec = json.loads(config.read_text())
    ids = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    spec["eos_token_id"] = next(t["id"] for t in ids if t["content"] == token)
    config.write_text(json.dumps(spec))


# --- the worker ------------------------------------------------------------------------------
def _prompt(seed: int) -> list[int]:
    """Tokens whose start the context has nothing to copy from: a drafter drafts there."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(60)]


def _spec(end: Finished) -> dict[str, int]:
    return dict((end.prefixd or {}).get("speculative") or {})


async def _reply(gen: Generator, tokens: list[int]) -> tuple[str, dict[str, int]]:
    text, _, end = await collect(gen.submit(Prompt(tokens, []), GREEDY, 40, namespace="a"))
    return text, _spec(end)


async def _cache_info(gen: Generator) -> dict[str, Any]:
    """The worker's `GET /v1/cache`, through its app."""
    settings = WorkerSettings(_env_file=None, use_system_blas=False)
    async with TestClient(TestServer(create_app(gen, "tiny", settings))) as client:
        resp = await client.get("/v1/cache")
        assert resp.status == 200
        return await resp.json()


def _loaded(folder: Path, caplog: pytest.LogCaptureFixture, **extra: Any
            ) -> tuple[Generator, list[str]]:
    """A worker on `folder` and the warnings it logged while loading."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefixd.worker"):
        gen = untimed(folder, **extra)
    return gen, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def worker(caplog: pytest.LogCaptureFixture
           ) -> Iterator[Callable[..., tuple[Generator, list[str]]]]:
    """`worker(folder, **settings)`: a loaded worker (closed after the test) and its warnings."""
    started: list[Generator] = []

    def start(folder: Path, **extra: Any) -> tuple[Generator, list[str]]:
        gen, warnings = _loaded(folder, caplog, **extra)
        started.append(gen)
        return gen, warnings

    yield start
    for gen in started:
        gen.close()


# --- the model's MTP head --------------------------------------------------------------------
@pytest.fixture(scope="module")
def head_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_next writing three words (prompt lookup drafts its replies), with a head."""
    return save_tiny_model("qwen3_next", tmp_path_factory.mktemp("head") / "m", words=3,
                           mtp=True)


@pytest.fixture(scope="module")
def head_replies(head_model: Path) -> Iterator[list[str]]:
    """The replies to `_prompt(0..2)` of a worker on `head_model` without speculation."""
    import asyncio

    gen = untimed(head_model, speculative=False)
    try:
        yield [asyncio.run(_reply(gen, _prompt(s)))[0] for s in range(3)]
    finally:
        gen.close()


async def test_a_head_of_nan_weights_is_refused_and_the_worker_drafts_by_lookup(
        head_model: Path, head_replies: list[str], tmp_path: Path,
        worker: Callable[..., tuple[Generator, list[str]]]) -> None:
    """The outside check's head: every weight NaN. Not used, a warning and `/v1/cache` say
    why; the replies are those without speculation and prompt lookup drafts them, the head
    nothing."""
    folder = _copy(head_model, tmp_path / "nan")
    _rewrite(folder / MTP_FILE, _all_nan)
    gen, warnings = worker(folder)
    info = (await _cache_info(gen))["speculative"]
    assert info["mtp"] is False
    refused = info["refused"]["mtp"]
    assert refused["name"] == str(folder) and "NaN" in refused["reason"]
    assert any("MTP head is not used" in w and "not all finite" in w and str(folder) in w
               for w in warnings), warnings
    spec = {"drafted": 0, "model_drafted": 0}
    for seed, want in enumerate(head_replies):
        text, got = await _reply(gen, _prompt(seed))
        assert text == want
        for k in spec:
            spec[k] += got.get(k, 0)
    assert spec["model_drafted"] == 0 and spec["drafted"] > 0


@pytest.mark.parametrize("damage,why", [
    (_set_one("mtp.fc.weight", float("inf")), "not all finite: fc.weight holds infinities"),
    (_set_one("mtp.norm.weight", float("nan")), "not all finite: norm.weight holds NaN"),
    (_without("mtp.fc.weight"), "do not fit the model: Missing 1 parameters: fc.weight."),
    (_transposed("mtp.fc.weight"), "do not fit the model: Expected shape (64, 128)"),
    (lambda w: w, None),
], ids=["inf", "nan-in-one-norm", "missing-tensor", "misshaped-tensor", "sound"])
async def test_a_damaged_head_file_is_refused_and_named(
        head_model: Path, head_replies: list[str], tmp_path: Path,
        worker: Callable[..., tuple[Generator, list[str]]],
        damage: Callable[[Weights], Weights], why: str | None) -> None:
    """Each way a head file can be damaged: refused with its reason (logged, in
    `/v1/cache`), the model served without it; the sound file's head drafts."""
    folder = _copy(head_model, tmp_path / "m")
    _rewrite(folder / MTP_FILE, damage)
    gen, warnings = worker(folder)
    assert gen.loaded is not None
    info = gen.loaded.engine.cache_info()["speculative"]
    text, spec = await _reply(gen, _prompt(0))
    assert text == head_replies[0]
    if why is None:
        assert info["mtp"] is True and info["refused"] == {}
        assert spec["model_drafted"] > 0
        return
    assert info["mtp"] is False
    assert why in info["refused"]["mtp"]["reason"]
    assert any("MTP head is not used" in w and why in w for w in warnings), warnings
    assert spec.get("model_drafted", 0) == 0


# --- a draft model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3 writing six words; a copy of it drafts for it (every draft right)."""
    return save_tiny_model("qwen3", tmp_path_factory.mktemp("served") / "m", words=6)


@pytest.fixture(scope="module")
def served_replies(served: Path) -> Iterator[list[str]]:
    import asyncio

    gen = untimed(served, speculative=False)
    try:
        yield [asyncio.run(_reply(gen, _prompt(s)))[0] for s in range(2)]
    finally:
        gen.close()


def _nan_weight(folder: Path) -> None:
    _rewrite(folder / "model.safetensors",
             _set_one("model.layers.1.mlp.down_proj.weight", float("nan")))


def _inf_weight(folder: Path) -> None:
    _rewrite(folder / "model.safetensors",
             _set_one("model.embed_tokens.weight", float("-inf")))


def _other_ids(folder: Path) -> None:
    _swap_tokens(folder, "Ġriver", "Ġcache")


def _other_eos(folder: Path) -> None:
    _ends_on(folder, tinytok.PAD)


def _missing_tensor(folder: Path) -> None:
    _rewrite(folder / "model.safetensors", _without("model.norm.weight"))


@pytest.mark.parametrize("damage,why", [
    (_nan_weight, "not all finite: model.layers.1.mlp.down_proj.weight holds NaN"),
    (_inf_weight, "not all finite: model.embed_tokens.weight holds infinities"),
    (_other_ids, "maps 2 token ids to other tokens"),
    (_other_eos, "end-of-sequence token ids are [0], the served model's [2]"),
    (_missing_tensor, "does not load (ValueError: Missing 1 parameters: model.norm.weight."),
    (lambda folder: None, None),
], ids=["nan-weight", "inf-weight", "ids-name-other-tokens", "other-eos", "missing-tensor",
        "sound"])
async def test_a_draft_model_that_cannot_draft_for_the_served_model_is_refused_and_named(
        served: Path, served_replies: list[str], tmp_path: Path,
        worker: Callable[..., tuple[Generator, list[str]]],
        damage: Callable[[Path], None], why: str | None) -> None:
    """A copy of the served model drafting for it, damaged one way: refused with its reason
    (a warning naming it, `/v1/cache`), the model served without it, prompt lookup still on;
    the sound copy drafts."""
    draft = _copy(served, tmp_path / "draft")
    damage(draft)
    gen, warnings = worker(served, spec_draft_model=str(draft))
    info = (await _cache_info(gen))["speculative"]
    text, spec = await _reply(gen, _prompt(1))
    assert text == served_replies[1]
    assert spec["drafted"] > 0     # prompt lookup, or the draft model too
    if why is None:
        assert info["draft_model"] is True and info["refused"] == {}
        assert spec["model_drafted"] > 0
        return
    assert info["draft_model"] is False
    assert info["refused"]["draft_model"]["name"] == str(draft)
    assert why in info["refused"]["draft_model"]["reason"]
    assert any(f"draft model {draft} is not used" in w and why in w for w in warnings), warnings
    assert spec.get("model_drafted", 0) == 0
