"""A decode batch's full-attention KV whose rows may hold gaps: the positions a batched verify
pass wrote for a row and the row did not keep (drafted tokens it rejected, padding up to the
batch's longest draft).

Owns: `GappedKVCache`, mlx-lm's `BatchKVCache` with a per-row mask of gap positions. Why: a
batch's rows end at one index, so a row that keeps fewer positions of a verify pass than
another must lose its tail, and mlx-lm masks left padding only: its way (`prepare(right_padding)`
+ `finalize`) rolls every row's whole KV buffer to move the tail into the padding, after every
verify pass. Measured on the built-in model (5 rows of ~1,700 tokens): a roll took ~190 ms, more
than a plain batched step (~180 ms), so speculation in a batch ran slower than without it. Here
the tail stays where it is and is masked (attention gives it zero weight: the row's logits are
those of the row without it), and each row's `offset` (its RoPE position) counts only what it
kept. The gaps are squeezed out (`compact`: one gather for all rows) when they grow past
`MAX_GAP` positions in a row, and before any change of membership (`extend`, `filter`,
`extract`), so a run that leaves gets back a plain contiguous `KVCache`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

# Gap positions a row may hold before the batch squeezes them out: about the spare positions
# a batch's buffers grow by (`stacking.GROWTH`), so gaps cost at most that much memory per row.
MAX_GAP = 64


class GappedKVCache(BatchKVCache):
    """`BatchKVCache` plus `gaps` ([rows, positions] bool, True: masked; None: no gaps)."""

    def __init__(self, left_padding: list[int]) -> None:
        super().__init__(left_padding)
        self.gaps: mx.array | None = None

    def drop(self, drops: list[int]) -> bool:
        """Row i no longer holds its last `drops[i]` positions: all rows trimmed by the
        fewest, the rest of each row's tail masked as a gap (no data moves). Whether the
        gaps were then squeezed out (a row's passed `MAX_GAP`)."""
        least = min(drops)
        if least:
            self.trim(least)
        rest = [d - least for d in drops]
        if not any(rest):
            return False
        gaps = np.zeros((len(rest), self._idx), dtype=bool)
        if self.gaps is not None:
            gaps[:, :self.gaps.shape[1]] = np.array(self.gaps[:, :self._idx])
        for row, r in enumerate(rest):
            gaps[row, self._idx - r:self._idx] = r > 0
        self.gaps = mx.array(gaps)
        self.offset = self.offset - mx.array(rest)
        if gaps.sum(axis=1).max() <= MAX_GAP:
            return False
        self.compact()
        return True

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self.gaps is not None and self.gaps.shape[1] > self._idx:
            self.gaps = self.gaps[:, :self._idx]
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        if self.gaps is None:
            return mask
        width = self._idx + N
        gaps = self.gaps[:, :width]
        if gaps.shape[1] < width:
            gaps = mx.pad(gaps, [(0, 0), (0, width - gaps.shape[1])])
        return mask & ~gaps[:, None, None, :]

    def compact(self) -> None:
        """Squeeze the gaps out: each row's kept positions right-aligned at `_idx` (its left
        padding grown by its gaps), in one gather of every row."""
        if self.gaps is None or self.keys is None:
            self.gaps = None
            return
        n = self._idx
        pads = np.array(self.left_padding.tolist())
        gaps = np.array(self.gaps[:, :n])
        gaps = np.pad(gaps, [(0, 0), (0, n - gaps.shape[1])])
        keep = ~gaps & (np.arange(n)[None, :] >= pads[:, None])
        index = np.zeros((len(pads), n), dtype=np.int32)
        for row in range(len(pads)):
            kept = np.flatnonzero(keep[row])
            index[row, n - len(kept):] = kept
            pads[row] = n - len(kept)
        at = mx.array(index)[:, None, :, None]
        self.keys = mx.take_along_axis(self.keys[..., :n, :], at, axis=2)
        self.values = mx.take_along_axis(self.values[..., :n, :], at, axis=2)
        self.left_padding = mx.array(pads)
        self.gaps = None

    def filter(self, batch_indices: Any) -> None:
        self.compact()
        super().filter(batch_indices)

    def extend(self, other: Any) -> None:
        self.compact()
        if isinstance(other, GappedKVCache):
            other.compact()
        super().extend(other)

    def extract(self, idx: int) -> KVCache:
        self.compact()
        return super().extract(idx)
