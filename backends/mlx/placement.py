"""Where checkpoints go: pure placement policy over token positions, no state, no mlx.

Owns: the longest-common-prefix helper, the checkpoint positions of one prompt
(`placement_marks`: message boundaries, the prompt end and its tail, in-message interval marks)
and the automatic in-message interval sized to the checkpoint bytes and the budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import pairwise

_BLOCK = 256
AUTO_CONTEXT = 32_768  # tokens of the long conversation `auto_interval` provisions for
AUTO_SHARE = 4  # ... whose interval checkpoints may take 1/AUTO_SHARE of the budget


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (block-wise, in C for long runs)."""
    n = min(len(a), len(b))
    lo = 0
    while lo < n:
        hi = min(lo + _BLOCK, n)
        if a[lo:hi] != b[lo:hi]:
            return next(i for i in range(lo, hi) if a[i] != b[i])
        lo = hi
    return n


def placement_marks(n: int, start: int, boundaries: Iterable[int], interval: int,
                    tail: int) -> dict[int, bool]:
    """Checkpoint positions in `(start, n]` for a prompt of `n` tokens restored at `start`,
    ascending, each mapped to whether it is an in-message interval mark.

    Message boundaries, the prompt end, one token before it (an exact repeat restores at most
    there: its last token is recomputed for its logits), `tail` tokens before it, and every
    `interval` tokens after each boundary (so positions depend on the prompt only, not on where
    this request restored).
    """
    fixed = {b for b in boundaries if 0 < b <= n}
    fixed.add(n)
    fixed.update(p for p in (n - 1, n - tail) if 0 < p < n)
    anchors = sorted({0, *fixed})
    extra: set[int] = set()
    for a, b in pairwise(anchors):
        extra.update(range(a + interval, b, interval))
    return {p: p not in fixed for p in sorted(fixed | extra) if start < p <= n}


def placement(n: int, start: int, boundaries: Iterable[int], interval: int, tail: int) -> list[int]:
    """The positions of `placement_marks`."""
    return list(placement_marks(n, start, boundaries, interval, tail))


def auto_interval(checkpoint_bytes: int, budget: int, *, context: int = AUTO_CONTEXT,
                  share: int = AUTO_SHARE, lo: int = 64, hi: int = 4096) -> int:
    """The in-message checkpoint interval for checkpoints of `checkpoint_bytes` each.

    The smallest power of two >= `lo` such that the interval checkpoints of one `context`-token
    conversation take at most `budget / share`, clamped to `[lo, hi]`: tiny or pure-attention
    models get `lo`, large hybrids (a Qwen3-Next-80B checkpoint is ~75-150 MB) thousands.
    """
    interval = lo
    while interval < hi and (context // interval) * checkpoint_bytes > budget // share:
        interval *= 2
    return interval
