"""Content addresses of token prefixes for the disk tier: pure, no mlx.

Owns: the hash chain over token ids (block `j` covers positions `[j*B, (j+1)*B)`; its id hashes
the id of block `j-1` and its own tokens, so an id names the whole prefix up to the block's end),
the id of a state record at any position (the chain up to the last whole block + the tail
tokens), and the longest common prefix of two token arrays. A salt (the cache key: model files,
tokenizer, cache layout, format) starts every chain, so ids of different models never meet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ID_BYTES = 16


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous int32 array (the form that is hashed and stored)."""
    return np.ascontiguousarray(np.asarray(tokens, dtype=np.int32))


def block_ids(salt: str, tokens: np.ndarray, block: int) -> list[str]:
    """Ids of the whole blocks of `tokens`: `ids[j]` names `tokens[:(j+1)*block]`."""
    out: list[str] = []
    prev = hashlib.blake2b(salt.encode(), digest_size=ID_BYTES).hexdigest()
    for j in range(len(tokens) // block):
        prev = next_block_id(prev, tokens[j * block:(j + 1) * block])
        out.append(prev)
    return out


def next_block_id(parent: str, tokens: np.ndarray) -> str:
    """The id of the block holding `tokens` right after the block (or salt digest) `parent`."""
    h = hashlib.blake2b(bytes.fromhex(parent), digest_size=ID_BYTES)
    h.update(tokens.tobytes())
    return h.hexdigest()


def record_id(salt: str, tokens: np.ndarray, pos: int, block: int,
              ids: list[str] | None = None) -> str:
    """Id of the state at `pos`: the chain up to its last whole block, then its tail tokens."""
    ids = ids if ids is not None else block_ids(salt, tokens[:pos], block)
    whole = pos // block
    h = hashlib.blake2b(bytes.fromhex(ids[whole - 1]) if whole else salt.encode(),
                        digest_size=ID_BYTES, person=b"prefixd-record")
    h.update(tokens[whole * block:pos].tobytes())
    h.update(pos.to_bytes(8, "little"))
    return h.hexdigest()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n
