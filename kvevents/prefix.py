"""Ids of token prefixes: pure (hashlib, numpy), shared by the publisher and the subscriber.

A prefix of a token list is named by a chain over whole chunks of `CHUNK` tokens: `key(0)`
hashes a seed, `key(j + 1)` hashes `key(j)` and the `j`-th chunk's token ids, so equal keys
mean equal prefixes up to there; a prefix ending at any position `p` is then `key(p // CHUNK)`
plus its tail, `tokens[CHUNK * (p // CHUNK):p]`. `Path.id_at(p)` is the 64-bit id prefixd's
publisher announces for it (vLLM's block hashes are 64-bit ints too); the subscriber indexes
what it was told by `(key, tail)` and finds a prompt's prefixes by walking its keys.

The seed separates models (a publisher seeds with its model's identity); it never leaves
the process that hashes, so consumers, who rebuild their keys from the announced token ids
(as llm-d does), need not know it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

CHUNK = 16         # tokens per chunk: vLLM's default block size (metrics/vllm.py's too)
_KEY = 16          # bytes of a chunk key


def seed_key(seed: str) -> bytes:
    return hashlib.blake2b(seed.encode(), digest_size=_KEY, person=b"prefixd-kv").digest()


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian int32 bytes: what is hashed."""
    return np.asarray(tokens, dtype="<i4").tobytes()


def next_key(key: bytes, chunk: bytes) -> bytes:
    return hashlib.blake2b(key + chunk, digest_size=_KEY).digest()


def position_id(key: bytes, tail: bytes, pos: int) -> int:
    """The id of the prefix ending at `pos` whose last whole chunk's key is `key`."""
    h = hashlib.blake2b(key + tail, digest_size=8, person=b"prefixd-pos")
    h.update(pos.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "big")


class Path:
    """One token list and the keys of its chunks, computed as far as asked (then kept)."""

    __slots__ = ("keys", "n", "plan", "raw")

    def __init__(self, seed: bytes, tokens: Sequence[int] | np.ndarray) -> None:
        self.raw = token_bytes(tokens)
        self.n = len(self.raw) // 4
        self.keys = [seed]
        self.plan: tuple[tuple[int, ...], Any] | None = None   # `forest.path_nodes`' memo

    def key(self, j: int) -> bytes:
        """The key of the first `j` chunks."""
        while len(self.keys) <= j:
            i = len(self.keys) - 1
            self.keys.append(next_key(self.keys[i], self.raw[4 * CHUNK * i:4 * CHUNK * (i + 1)]))
        return self.keys[j]

    def tail(self, pos: int) -> bytes:
        return self.raw[4 * CHUNK * (pos // CHUNK):4 * pos]

    def id_at(self, pos: int) -> int:
        """The id of `tokens[:pos]` (0 < pos <= len)."""
        return position_id(self.key(pos // CHUNK), self.tail(pos), pos)

    def tokens(self, start: int, end: int) -> list[int]:
        return np.frombuffer(self.raw[4 * start:4 * end], dtype="<i4").tolist()
