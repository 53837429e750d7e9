"""What the disk index knows of each file, and prefix questions answered without copies.

Owns: `Record` (one state on disk: its position, the ids of its whole blocks and the tokens of
its tail) and `Block` (one KV block: its size, its tokens, how many records need it). A record
does not hold its own token list: thousands of records of one long conversation would each
copy tens of thousands of ids. Its tokens are its blocks' (shared by every record on that
prefix) then its tail, and the chain property answers prefix questions: two records share
their first `k` blocks exactly when their `k`-th block ids are equal. Pure (numpy, no mlx).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixd.backends.mlx.disk import chain


@dataclass
class Block:
    nbytes: int
    tokens: np.ndarray
    refs: int = 0


@dataclass(eq=False)
class Record:
    """A state at `pos`: its tokens are its blocks' (the last one possibly past `pos`),
    then `tail` (the tokens past its last block; empty when the blocks cover `pos`)."""

    rid: str
    pos: int
    blocks: tuple[str, ...]
    tail: np.ndarray
    nbytes: int
    trimmable: bool
    last_used: float
    gap: int = 0            # tokens beyond the nearest record below it on the same prefix

    @property
    def path_name(self) -> str:
        return self.rid + ".safetensors"


def shared_blocks(a: tuple[str, ...] | list[str], b: tuple[str, ...] | list[str]) -> int:
    """How many leading block ids two chains share (binary search: ids name whole prefixes)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def segment(r: Record, k: int, blocks: dict[str, Block], block: int) -> np.ndarray:
    """The record's tokens from `k * B` (within one block, or its tail), up to `pos`."""
    seg = blocks[r.blocks[k]].tokens if k < len(r.blocks) else r.tail
    return seg[:max(0, r.pos - k * block)]


def common_prefix(r: Record, prompt: np.ndarray, prompt_ids: list[str],
                  blocks: dict[str, Block], block: int) -> int:
    """Length of the common prefix of `r`'s tokens and `prompt` (whose block ids are given)."""
    k = min(shared_blocks(r.blocks, prompt_ids), r.pos // block)
    seg = segment(r, k, blocks, block)
    return k * block + chain.common_prefix(seg, prompt[k * block:k * block + len(seg)])


def is_prefix(low: Record, high: Record, blocks: dict[str, Block], block: int) -> bool:
    """Whether `low`'s tokens are a prefix of `high`'s."""
    if low.pos > high.pos:
        return False
    k = low.pos // block
    if shared_blocks(low.blocks, high.blocks) < k:
        return False
    mine = segment(low, k, blocks, block)
    theirs = segment(high, k, blocks, block)
    return len(theirs) >= len(mine) and chain.common_prefix(mine, theirs) == len(mine)


def tokens(r: Record, blocks: dict[str, Block]) -> np.ndarray:
    """The record's whole token list (a copy: for rare uses such as the eviction ledger)."""
    whole = [blocks[b].tokens for b in r.blocks if b in blocks]
    return np.concatenate([*whole, r.tail])[:r.pos]
