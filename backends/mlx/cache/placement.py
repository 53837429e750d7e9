"""Where checkpoints go: pure placement policy over token positions, no state, no mlx.

Owns: the longest-common-prefix helper, the checkpoint positions of one prompt
(`placement_marks`: message boundaries, the prompt end and its tail, in-message interval marks)
with where its last forward pass starts (`prefill_plan`), and the automatic in-message interval
sized to the checkpoint bytes and the budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import pairwise

_BLOCK = 256
AUTO_CONTEXT = 32_768  # tokens of the long conversation `auto_interval` provisions for
AUTO_SHARE = 4  # ... whose interval checkpoints may take 1/AUTO_SHARE of the budget
# A checkpoint less than this many tokens above the restore point saves less than the extra
# forward pass it costs (the cut in the prefill): e.g. the next user message's content start, a
# role header above the previous reply's end.
MIN_GAP = 8
# A generation prompt is at most this long (a role header, maybe an opened think block): a
# boundary that close to the prompt end is the last message's end.
TAIL_REACH = 32
# The automatic interval keeps the extra passes of interval checkpoints under this share of the
# prefill time.
PASS_SHARE = 0.02


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


def tail_mark(n: int, boundaries: Iterable[int], tail: int) -> int | None:
    """Where the last forward pass of a prompt of `n` tokens starts, and a checkpoint is taken:
    the last message's end (the last boundary within `TAIL_REACH` (or `2 * tail`) tokens of the
    end: the generation prompt starts there, and the next turn often re-renders it
    differently), else `max(tail, 1)` tokens before the end. The prefill passes through it
    anyway (the last pass yields the logits), so this checkpoint costs no extra pass. An exact
    repeat restores here and recomputes these few tokens in one pass."""
    near = [b for b in boundaries if n - max(TAIL_REACH, 2 * tail) <= b < n]
    pos = max(near) if near else n - max(tail, 1)
    if pos <= 0:  # a prompt shorter than the tail
        pos = n - 1
    return pos if pos > 0 else None


def placement_marks(n: int, start: int, boundaries: Iterable[int], interval: int, tail: int,
                    *, min_gap: int = MIN_GAP, trim_below: int = 0) -> dict[int, bool]:
    """Checkpoint positions in `(start, n]` for a prompt of `n` tokens restored at `start`,
    ascending, each mapped to whether it is an in-message interval mark.

    Message boundaries, the prompt end, the tail mark (`tail_mark`), and every `interval`
    tokens after each boundary (so positions depend on the prompt only, not on where this
    request restored). Each mark but the end costs a cut in the prefill (one more forward
    pass), so marks that would buy little are left out:

    - marks less than `min_gap` tokens above `start` (but the end and the tail mark, which cost
      no cut): `start` itself stays a restore point (the entry restored from, or its
      checkpoint, moves to this request's entry);
    - with `trim_below` (the smallest sliding window, when windows are the only layers that
      need snapshots), every mark below it but the highest: a checkpoint taken before the
      window wraps is trimmed back to any shorter prefix, so it serves the lower ones.
    """
    bounds = {b for b in boundaries if 0 < b < n}
    fixed = {*bounds, n}
    last = tail_mark(n, bounds, tail)
    if last is not None:
        fixed.add(last)
    anchors = sorted({0, *fixed})
    extra: set[int] = set()
    for a, b in pairwise(anchors):
        extra.update(range(a + interval, b, interval))
    free = {n, last}  # passes end there anyway
    marks = sorted(p for p in fixed | extra if start < p <= n and (p >= start + min_gap
                                                                    or p in free))
    low = [p for p in marks if p < trim_below]
    marks = [p for p in marks if p >= trim_below or p == low[-1]]
    return {p: p not in fixed for p in marks}


def prefill_plan(n: int, start: int, boundaries: Sequence[int], interval: int, tail: int,
                 *, trim_below: int = 0) -> tuple[dict[int, bool], int]:
    """(checkpoint positions of this prompt, where its last forward pass starts).

    The last pass is the only one whose logits are computed, so it is kept short: the last
    token, as stock mlx-lm's (the passes before it skip the last layer's work past what the
    cache needs, and lm_head), or from the tail mark a few tokens earlier, which then is a
    checkpoint without an extra pass."""
    marks = placement_marks(n, start, boundaries, interval, tail, trim_below=trim_below)
    last = tail_mark(n, [b for b in boundaries if 0 < b < n], tail)
    return marks, last if last is not None and last in marks else n - 1


def placement(n: int, start: int, boundaries: Iterable[int], interval: int, tail: int,
              **kw: int) -> list[int]:
    """The positions of `placement_marks`."""
    return list(placement_marks(n, start, boundaries, interval, tail, **kw))


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


def compute_interval(pass_s: float, token_s: float, *, share: float = PASS_SHARE, lo: int = 64,
                     hi: int = 4096) -> int:
    """The in-message checkpoint interval whose extra forward passes (one per interval mark,
    `pass_s` each) cost at most `share` of prefilling the interval (`token_s` per token): the
    smallest power of two >= `lo` with `pass_s <= share * interval * token_s`, clamped to
    `[lo, hi]`. Small models pay a large fixed cost per pass for little work per token."""
    interval = lo
    while interval < hi and pass_s > share * interval * token_s:
        interval *= 2
    return interval
