"""`POST /v1/cache/import` treats its body as untrusted input (issue 25): a forged bundle (a
victim conversation's token ids, random tensors, the checksum recomputed) is refused for want
of a MAC from a worker holding this worker's transfer secret, and a fuzz of the endpoint
(bytes flipped anywhere, truncations, NaN/Inf, token ids of other dtypes or outside the
vocabulary, tensors of other dtypes, extra tensors, wrong or missing MACs, too large) gets a
named 4xx every time, counted, with nothing stored: the victim conversation then answers
exactly as cold. Two in-process workers of one tiny Qwen3 (a source and a target) on real
loopback servers."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from aiohttp.test_utils import TestClient, TestServer

from prefixd.backends.mlx.engine.transfer import bundle
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.server import seal
from prefixd.backends.mlx.server.app import create_app
from prefixd.backends.mlx.settings import WorkerSettings
from tests.worker_fixtures import loaded

SECRET = "the transfer secret of the fuzz"
NAME = "tiny"
NAMED = {"no_transfer_secret", "unsigned_bundle", "bad_mac", "too_large", "other_model",
         "not_a_bundle", "damaged", "bad_position", "bad_tokens", "token_out_of_vocabulary",
         "wrong_dtype", "not_finite", "wrong_shape", "wrong_structure"}
X = [{"role": "system", "content": "You index every file of the repository. " * 10},
     {"role": "user", "content": "Which file holds the parser?"}]
Y = [{"role": "system", "content": "You are the bank's assistant. Keep accounts private. " * 8},
     {"role": "user", "content": "What is my balance?"}]


def _settings(tmp: Path, secret: str | None = SECRET) -> WorkerSettings:
    return WorkerSettings(_env_file=None, max_tokens_default=6, use_system_blas=False,
                          cache_dir=tmp, disk_cache_bytes=0, transfer_secret=secret)


@pytest.fixture
def pair(tiny_model_dir: Callable[[str], Path], tmp_path: Path
         ) -> Iterator[tuple[Generator, Generator]]:
    """(source, target): two workers of one model, each with its own empty prompt cache."""
    gens = []
    for _ in range(2):
        gen = Generator(_settings(tmp_path))
        loaded(gen, str(tiny_model_dir("qwen3")))
        gens.append(gen)
    yield gens[0], gens[1]
    for gen in gens:
        gen.close()


async def _client(gen: Generator, settings: WorkerSettings) -> TestClient:
    client = TestClient(TestServer(create_app(gen, NAME, settings)))
    await client.start_server()
    return client


@pytest.fixture
async def clients(pair: tuple[Generator, Generator], tmp_path: Path
                  ) -> AsyncIterator[tuple[TestClient, TestClient]]:
    source = await _client(pair[0], _settings(tmp_path))
    target = await _client(pair[1], _settings(tmp_path))
    yield source, target
    await source.close()
    await target.close()


def _body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": NAME, "messages": messages, "temperature": 0, "max_tokens": 6}


async def _answer(client: TestClient, messages: list[dict[str, Any]]) -> tuple[str, int]:
    r = await client.post("/v1/chat/completions", json=_body(messages))
    assert r.status == 200, await r.text()
    out = await r.json()
    return (out["choices"][0]["message"]["content"],
            out["usage"]["prompt_tokens_details"]["cached_tokens"])


async def _export(client: TestClient, messages: list[dict[str, Any]]) -> tuple[bytes, str]:
    r = await client.post("/v1/cache/export", json=_body(messages))
    assert r.status == 200
    return await r.read(), r.headers.get(seal.HEADER, "")


# --- taking a bundle apart and putting it back together (checksum recomputed) ---------------
def _open(data: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(json.loads(data[8:8 + n])["__metadata__"]["prefixd"])
    return meta, dict(safetensors.numpy.load(data))


def _close(meta: dict[str, Any], tensors: dict[str, np.ndarray]) -> bytes:
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    meta = {**meta, "digest": bundle._digest(tensors)}
    return safetensors.numpy.save(tensors, metadata={"prefixd": json.dumps(meta)})


def _rework(data: bytes, change: Callable[[dict[str, Any], dict[str, np.ndarray]], None]
            ) -> bytes:
    meta, tensors = _open(data)
    change(meta, tensors)
    return _close(meta, tensors)


def _forged(data: bytes) -> bytes:
    """The attack: the victim's real token ids, every state tensor `randn * 30`."""
    rng = np.random.default_rng(0)

    def fill(meta: dict[str, Any], t: dict[str, np.ndarray]) -> None:
        for k, v in t.items():
            if k != "tokens":
                t[k] = (rng.standard_normal(v.shape) * 30).astype(v.dtype)

    return _rework(data, fill)


def _first_state(t: dict[str, np.ndarray]) -> str:
    return sorted(k for k in t if k != "tokens")[0]


def _set(name: str, value: Callable[[np.ndarray], np.ndarray]
         ) -> Callable[[dict[str, Any], dict[str, np.ndarray]], None]:
    def change(meta: dict[str, Any], t: dict[str, np.ndarray]) -> None:
        key = _first_state(t) if name == "state" else name
        t[key] = value(t[key])
    return change


def _poke(v: np.ndarray, x: float) -> np.ndarray:
    v = v.copy()
    v.flat[v.size // 2] = x
    return v


def _content_cases(data: bytes) -> dict[str, tuple[bytes, str]]:
    """Bundles a worker holding the secret could sign by mistake (a bug, not an attacker):
    each still refused by the content checks, for its named reason."""
    def extra(meta: dict[str, Any], t: dict[str, np.ndarray]) -> None:
        t["stowaway"] = np.zeros((1 << 12,), np.float32)

    def marked_bf16(meta: dict[str, Any], t: dict[str, np.ndarray]) -> None:
        meta["dtypes"] = {_first_state(t): "bfloat16"}

    def fewer_positions(meta: dict[str, Any], t: dict[str, np.ndarray]) -> None:
        k = _first_state(t)
        t[k] = t[k][..., :-1, :]

    cases: dict[str, tuple[Any, str]] = {
        "NaN": (_set("state", lambda v: _poke(v, np.nan)), "not_finite"),
        "+Inf": (_set("state", lambda v: _poke(v, np.inf)), "not_finite"),
        "-Inf": (_set("state", lambda v: _poke(v, -np.inf)), "not_finite"),
        "float ids": (_set("tokens", lambda v: v.astype(np.float32)), "bad_tokens"),
        "int64 ids": (_set("tokens", lambda v: v.astype(np.int64)), "bad_tokens"),
        "uint32 ids": (_set("tokens", lambda v: v.astype(np.uint32)), "bad_tokens"),
        "negative id": (_set("tokens", lambda v: _poke(v, -1)), "token_out_of_vocabulary"),
        "2^30 id": (_set("tokens", lambda v: _poke(v, 2**30)), "token_out_of_vocabulary"),
        "vocab-sized id": (_set("tokens", lambda v: _poke(v, 1 << 20)),
                           "token_out_of_vocabulary"),
        "float64 state": (_set("state", lambda v: v.astype(np.float64)), "wrong_dtype"),
        "float16 state": (_set("state", lambda v: v.astype(np.float16)), "wrong_dtype"),
        "int32 state": (_set("state", lambda v: v.astype(np.int32)), "wrong_dtype"),
        "float32 marked bfloat16": (marked_bf16, "wrong_dtype"),
        "an extra tensor": (extra, "wrong_structure"),
        "one position short": (fewer_positions, "wrong_shape"),
    }
    return {why: (_rework(data, change), reason) for why, (change, reason) in cases.items()}


# --- the target's side ------------------------------------------------------------------------
class Target:
    """Posts to the target's import endpoint and checks every refusal: a named 4xx, counted,
    nothing stored."""

    def __init__(self, client: TestClient, gen: Generator) -> None:
        self.client, self.engine = client, gen.loaded.engine  # type: ignore[union-attr]
        self.refused: dict[str, int] = {}

    async def post(self, data: bytes, tag: str | None, chunked: bool = False) -> tuple[int, Any]:
        headers = {"Content-Type": "application/octet-stream"}
        if tag is not None:
            headers[seal.HEADER] = tag

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(data), 4096):
                yield data[i:i + 4096]

        r = await self.client.post("/v1/cache/import", data=chunks() if chunked else data,
                                   headers=headers)
        return r.status, await r.json()

    async def refuses(self, data: bytes, tag: str | None, why: str,
                      reason: str | set[str] = NAMED, chunked: bool = False) -> str:
        status, answer = await self.post(data, tag, chunked)
        code = answer.get("error", {}).get("code") if isinstance(answer, dict) else None
        assert 400 <= status < 500 and code in NAMED, (why, status, answer)
        assert code == reason or (isinstance(reason, set) and code in reason), (why, code)
        assert self.engine.store.entries == [], why        # nothing of it was stored
        self.refused[code] = self.refused.get(code, 0) + 1
        return code

    async def counted(self) -> dict[str, float]:
        text = await (await self.client.get("/metrics")).text()
        return {line.split('outcome="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("prefixd_worker_cache_imports_total{")}


async def test_a_forged_bundle_is_refused_and_the_conversation_answers_cold(
        pair: tuple[Generator, Generator], clients: tuple[TestClient, TestClient]) -> None:
    source, client = clients
    target = Target(client, pair[1])
    cold = await _answer(source, Y)
    data, tag = await _export(source, Y)
    forged = _forged(data)
    await target.refuses(forged, None, "no MAC", "unsigned_bundle")
    await target.refuses(forged, tag, "the real bundle's MAC", "bad_mac")
    await target.refuses(forged, seal.sign("a secret guessed by the attacker", forged),
                         "another secret's MAC", "bad_mac")
    await target.refuses(forged, "zz" * 32, "not hex", "unsigned_bundle")
    assert await _answer(client, Y) == (cold[0], 0)
    # the forgery is a well-formed bundle of this model (its checksum recomputed, its values
    # finite): only the MAC tells it from the real one
    vocab = len(pair[1].loaded.tokenizer)  # type: ignore[union-attr]
    await pair[1].call(lambda e: bundle.parse(forged, bundle.bundle_key(e), vocab))


async def test_contents_are_checked_even_when_signed(
        pair: tuple[Generator, Generator], clients: tuple[TestClient, TestClient]) -> None:
    """A peer holding the secret is trusted with values, not with their form: NaN/Inf, ids
    of another dtype or outside the vocabulary, tensors of another dtype or shape, an extra
    tensor: each a named refusal, nothing stored."""
    source, client = clients
    target = Target(client, pair[1])
    cold = await _answer(source, Y)
    data, _ = await _export(source, Y)
    for why, (blob, reason) in _content_cases(data).items():
        await target.refuses(blob, seal.sign(SECRET, blob), why, reason)
    assert await _answer(client, Y) == (cold[0], 0)


ODD_VALUES = [None, True, False, 0, -1, 1, 2**31, 2**64, 1.5, float("nan"), "", "x", "s0.0",
              "tokens", [], {}, [1], {"a": "s0.0"}, {"a": 3}, {"t": 5}, {"l": [{"a": "s0.0"}]},
              {"v": 1}, {"t": [{"a": "s0.0"}] * 3}, "KVCache", "ArraysCache", "bfloat16",
              {"s0.0": "bfloat16"}, {"0": {"class": "KVCache", "state": {"t": []}}}]


def _paths(x: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if path:
        yield path
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        yield from _paths(v, (*path, k))


def _replaced(meta: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(meta))
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


async def test_fuzzing_the_description(pair: tuple[Generator, Generator],
                                       clients: tuple[TestClient, TestClient]) -> None:
    """Any value of any field of a signed bundle's description (its checksum recomputed): a
    named refusal, never a 5xx, nothing stored."""
    source, client = clients
    target = Target(client, pair[1])
    await _answer(source, Y)
    data, _ = await _export(source, Y)
    meta, tensors = _open(data)
    paths = [p for p in _paths(meta) if p[0] != "digest"]
    rng = random.Random(26)
    for _ in range(300):
        path, value = rng.choice(paths), rng.choice(ODD_VALUES)
        changed = _replaced(meta, path, value)
        if json.dumps(changed) == json.dumps(meta):
            continue
        blob = _close(changed, tensors)
        await target.refuses(blob, seal.sign(SECRET, blob), f"{path} = {value!r}")
    assert sum(target.refused.values()) > 250


async def test_fuzzing_the_import_endpoint(pair: tuple[Generator, Generator],
                                           clients: tuple[TestClient, TestClient],
                                           tmp_path: Path) -> None:
    source, client = clients
    target = Target(client, pair[1])
    before = await target.counted()
    cold = {"x": await _answer(source, X), "y": await _answer(source, Y)}
    data, tag = await _export(source, Y)
    other, other_tag = await _export(source, X)
    rng = random.Random(25)
    # a bit flipped in every byte of the header (its length, the JSON description), and in
    # 200 bytes of the tensors, the last one among them
    header = 8 + int.from_bytes(data[:8], "little")
    spots = sorted({*range(header), *rng.sample(range(header, len(data)), 199), len(data) - 1})
    for i in spots:
        bit = 1 << rng.randrange(8)
        flipped = data[:i] + bytes([data[i] ^ bit]) + data[i + 1:]
        await target.refuses(flipped, tag, f"flip {i}", "bad_mac")
        await target.refuses(flipped, seal.sign(SECRET, flipped), f"flip {i}, signed")
    for n in sorted({0, 1, 7, 8, 9, *rng.sample(range(10, len(data)), 30), len(data) - 1}):
        await target.refuses(data[:n], tag, f"truncated to {n}", "bad_mac")
        await target.refuses(data[:n], seal.sign(SECRET, data[:n]), f"truncated to {n}, "
                             "signed")
    forged = _forged(data)
    for tag_of, t in (("none", None), ("X's", other_tag), ("Y's", tag), ("empty", ""),
                      ("short", tag[:-1]), ("upper", tag.upper())):
        await target.refuses(forged, t, f"forged, {tag_of} MAC",
                             {"unsigned_bundle", "bad_mac"})
    await target.refuses(data, other_tag, "X's MAC on Y's bundle", "bad_mac")
    engine = target.engine
    budget, engine.store.budget = engine.store.budget, len(data) - 1
    try:
        await target.refuses(data, tag, "Content-Length past the budget", "too_large")
        await target.refuses(data, tag, "streamed past the budget", "too_large", chunked=True)
    finally:
        engine.store.budget = budget
    unkeyed = await _client(pair[1], _settings(tmp_path, secret=None))
    try:
        status, answer = await Target(unkeyed, pair[1]).post(data, tag)
        assert (status, answer["error"]["code"]) == (403, "no_transfer_secret")
    finally:
        await unkeyed.close()
    counted = await target.counted()
    for code, n in target.refused.items():
        assert counted.get(code, 0) - before.get(code, 0) == n, code
    assert sum(target.refused.values()) > 2 * len(spots)
    # nothing was stored: the victim answers as cold; the real, signed bundle still moves
    assert await _answer(client, Y) == (cold["y"][0], 0)
    status, answer = await target.post(other, other_tag)
    assert status == 200 and answer["tokens"] > 0
    assert await _answer(client, X) == (cold["x"][0], answer["tokens"])
