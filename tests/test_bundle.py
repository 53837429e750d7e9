"""Moving a prefix's state between workers: a bundle exported by one engine and imported by
another engine of the same model restores like the first one's own cache (warm == cold, the
cached tokens exactly the exported position), and a bundle that is not this model's, or not a
bundle, is refused before anything is stored."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import SecretStr
from worker_fixtures import NAME, SETTINGS, chat, post

from prefixd.backends.mlx.engine.engine import Engine
from prefixd.backends.mlx.engine.tierglue import DiskSpec
from prefixd.backends.mlx.engine.transfer import bundle
from prefixd.backends.mlx.model.tiny import (
    ARCHS,
    TINY_VOCAB,
    build_model,
    model_from_config,
    tiny_config,
)
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.server import seal
from prefixd.backends.mlx.server.app import create_app
from tests.test_checkpoints import CountingModel, _assert_same, _cold, _run, _settings

SYSTEM = 150          # a shared head: every conversation's prompt starts with these tokens


@pytest.fixture(scope="module", params=ARCHS)
def model(request: pytest.FixtureRequest) -> CountingModel:
    return CountingModel(build_model(request.param, seed=3))


def _prompts(seed: int = 11) -> tuple[list[int], list[int]]:
    """Two conversations sharing a SYSTEM-token head, then different first messages."""
    rng = random.Random(seed)
    head = [rng.randrange(1, 1000) for _ in range(SYSTEM)]
    return ([*head, *(rng.randrange(1, 1000) for _ in range(90))],
            [*head, *(rng.randrange(1, 1000) for _ in range(70))])


def _engine(model: CountingModel, model_id: str = "tiny") -> Engine:
    return Engine(model, _settings(), model_id=model_id)


def test_an_imported_prefix_restores_like_the_exporters_own(model: CountingModel) -> None:
    first, second = _prompts()
    source = _engine(model)
    _run(source, first, (SYSTEM,))
    found = bundle.export(source, second)
    assert found is not None
    data, pos = found
    assert pos == SYSTEM                # the shared head: a boundary checkpoint, or any prefix
    target = _engine(model)
    assert bundle.import_(target, data, TINY_VOCAB) == SYSTEM
    model.tokens = 0
    warm = _run(target, second)
    assert warm[2].cached_tokens == SYSTEM
    assert model.tokens == len(second) - SYSTEM + 4     # the head was not computed again
    _assert_same(warm, _cold(model, second))


def test_a_prefix_the_worker_does_not_hold_exports_nothing(model: CountingModel) -> None:
    first, _ = _prompts()
    other, _ = _prompts(seed=12)
    source = _engine(model)
    _run(source, first, (SYSTEM,))
    assert bundle.export(source, other) is None
    assert bundle.export(_engine(model), first) is None


def _bundle(model: CountingModel) -> tuple[bytes, list[int]]:
    first, second = _prompts()
    source = _engine(model)
    _run(source, first, (SYSTEM,))
    found = bundle.export(source, second)
    assert found is not None
    return found[0], second


def _with_meta(data: bytes, change: dict) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    meta = json.loads(header["__metadata__"]["prefixd"])
    meta.update(change)
    header["__metadata__"]["prefixd"] = json.dumps(meta)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n:]


def test_bundles_that_are_not_this_models_state_are_refused(model: CountingModel) -> None:
    data, second = _bundle(model)
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(json.loads(data[8:8 + n])["__metadata__"]["prefixd"])
    leaf0 = meta["leaves"]["0"]
    bad = {
        "another model": (data, 409, "other_model"),
        "truncated": (data[: len(data) // 2], 400, "not_a_bundle"),
        "not safetensors": (b"\x00" * 64, 400, "not_a_bundle"),
        "position moved": (_with_meta(data, {"pos": SYSTEM - 1}), 400, "bad_tokens"),
        "leaf class": (_with_meta(data, {"leaves": {**meta["leaves"], "0": {
            **leaf0, "class": "ChunkedKVCache"}}}), 400, "wrong_structure"),
        "leaf missing": (_with_meta(data, {"leaves": {
            k: v for k, v in meta["leaves"].items() if k != "0"}}), 400, "wrong_structure"),
        "another kind": (_with_meta(data, {"kind": "x"}), 400, "not_a_bundle"),
        "a field more": (_with_meta(data, {"note": "x"}), 400, "not_a_bundle"),
        "leaves not a table": (_with_meta(data, {"leaves": 150}), 400, "wrong_structure"),
        "a state not a skeleton": (_with_meta(data, {"leaves": {**meta["leaves"], "0": {
            **leaf0, "state": {"t": 5}}}}), 400, "wrong_structure"),
        "a position that is a bool": (_with_meta(data, {"pos": True}), 400, "bad_position"),
        "a damaged value": (data[:-1] + bytes([data[-1] ^ 1]), 400, "damaged"),
    }
    for why, (blob, status, reason) in bad.items():
        target = _engine(model, "other" if why == "another model" else "tiny")
        with pytest.raises(bundle.BundleError) as e:
            bundle.import_(target, blob, TINY_VOCAB)
        assert (e.value.status, e.value.reason) == (status, reason), why
        assert target.store.entries == [], why
        assert _run(target, second)[2].cached_tokens == 0, why


def test_a_prefix_the_worker_holds_is_not_replaced(model: CountingModel) -> None:
    data, _ = _bundle(model)
    first, _ = _prompts()
    target = _engine(model)
    _run(target, first, (SYSTEM,))
    before = [(e, e.payload) for e in target.store.entries]
    assert bundle.import_(target, data, TINY_VOCAB) == SYSTEM
    assert [(e, e.payload) for e in target.store.entries] == before


def test_arrays_of_another_shape_are_refused() -> None:
    """A bundle from a model of the same classes but other sizes (its key forged to match)."""
    small = CountingModel(build_model("qwen3_next", seed=3))
    data, _ = _bundle(small)
    config = {**tiny_config("qwen3_next", TINY_VOCAB), "num_key_value_heads": 4,
              "linear_num_value_heads": 8}
    wide = Engine(model_from_config(config, 3), _settings(), model_id="tiny")
    forged = _with_meta(data, {"key": bundle.bundle_key(wide)})
    with pytest.raises(bundle.BundleError) as e:
        bundle.import_(wide, forged, TINY_VOCAB)
    assert (e.value.status, e.value.reason) == (400, "wrong_shape")
    assert wide.store.entries == []


# --- the worker's endpoints -----------------------------------------------------------------
SECRET = "a transfer secret of this test"


@pytest.fixture
async def signing(generator: Generator) -> AsyncIterator[TestClient]:
    """The worker app around the shared tiny model, with a transfer secret."""
    settings = SETTINGS.model_copy(update={"transfer_secret": SecretStr(SECRET)})
    async with TestClient(TestServer(create_app(generator, NAME, settings))) as c:
        yield c


def _signed(data: bytes, secret: str = SECRET) -> dict[str, str]:
    return {"Content-Type": "application/octet-stream", seal.HEADER: seal.sign(secret, data)}


async def test_export_and_import_over_http(signing: TestClient, generator: Generator) -> None:
    client = signing
    body = chat([{"role": "system", "content": "You keep every rule of the repository. " * 8},
                 {"role": "user", "content": "List the files."}], max_tokens=2)
    r = await client.post("/v1/cache/export", json=body)
    assert r.status == 404 and (await r.json())["error"]["code"] == "not_cached"
    await post(client, body)
    r = await client.post("/v1/cache/export", json=body)
    assert r.status == 200 and r.content_type == "application/octet-stream"
    pos = int(r.headers["X-Prefixd-Tokens"])
    data = await r.read()
    assert pos > 0 and r.headers[seal.HEADER] == seal.sign(SECRET, data)
    r = await client.post("/v1/cache/import", data=data, headers=_signed(data))
    assert r.status == 200 and (await r.json()) == {"tokens": pos}
    for bad in (b"", b"{}", data[:100], b"\xff" * 300):
        r = await client.post("/v1/cache/import", data=bad, headers=_signed(bad))
        err = (await r.json())["error"]
        assert r.status == 400 and err["code"] == "not_a_bundle", bad[:20]
    for bad_json in (b"[1]", b"{", b'{"messages": 3}'):
        r = await client.post("/v1/cache/export", data=bad_json)
        assert r.status == 400, bad_json
    engine = generator.loaded.engine  # type: ignore[union-attr]
    budget = engine.store.budget
    engine.store.budget = len(data) - 1
    try:
        r = await client.post("/v1/cache/import", data=data, headers=_signed(data))
        assert r.status == 413 and (await r.json())["error"]["code"] == "too_large"
    finally:
        engine.store.budget = budget


async def test_a_worker_without_a_secret_signs_nothing_and_imports_nothing(
        client: TestClient) -> None:
    body = chat([{"role": "system", "content": "You sign nothing at all. " * 8},
                 {"role": "user", "content": "List the files."}], max_tokens=2)
    await post(client, body)
    r = await client.post("/v1/cache/export", json=body)
    data = await r.read()
    assert r.status == 200 and seal.HEADER not in r.headers
    r = await client.post("/v1/cache/import", data=data, headers=_signed(data))
    assert r.status == 403 and (await r.json())["error"]["code"] == "no_transfer_secret"


def test_a_prefix_only_on_disk_exports_too(tmp_path: Path) -> None:
    """After a restart the RAM is empty and the disk tier holds the prefix: the export loads
    it from disk, as a request would."""
    model = CountingModel(build_model("qwen3_next", seed=3))
    first, second = _prompts()
    spec = DiskSpec(tmp_path, "tiny", 1 << 30, 0.0, 64)
    before = Engine(model, _settings(), spec)
    _run(before, first, (SYSTEM,))
    before.persist()
    assert before.close(30.0)
    after = Engine(model, _settings(), spec)
    found = bundle.export(after, second)
    after.close(5)
    assert found is not None and found[1] == SYSTEM
    target = _engine(model)
    assert bundle.import_(target, found[0], TINY_VOCAB) == SYSTEM
    warm = _run(target, second)
    assert warm[2].cached_tokens == SYSTEM
    _assert_same(warm, _cold(model, second))
