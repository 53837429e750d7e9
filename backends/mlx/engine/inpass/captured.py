"""What a tapped pass captured, at any of its offsets (`Captured`).

Owns: turning an in-pass tap's record (`engine/inpass/tap.py`: per recurrence its states after each
offset, or what it needs to compute them again; per convolution its padded input; a sliding
window's buffer after the pass) into the leaves a pass cut at an offset would have left, for
the whole batch of the pass or one row of it.

A recurrence is held one of two ways, chosen by whoever starts the tap:
- kept: its state after each offset, evaluated with the pass (one sync). Prefill checkpoints
  take every offset, and so do small models' verify passes;
- replayed (`Replay`): its state before the pass and its inputs per segment. The state at an
  offset is computed when asked for, by the same function over the same inputs and the same
  segments, one row at a time where a row is asked for, and nothing is held per offset. A
  verify pass keeps one state per drafted position and request, held until the request's next
  pass: on a large hybrid (Qwen3-Next-80B: 72 MiB of Gated-DeltaNet state per request) that is
  ~0.6 GiB per speculating request at 8 drafted tokens, so verify passes whose kept states would
  pass `spec_capture_bytes` replay instead (`speculate.replays`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from prefixd.backends.mlx.cache import snapshot


@dataclass
class Replay:
    """One tapped recurrence call, to run again: `orig` over `segments` (the call's arguments
    per segment, time-step inputs cut to it) from `state` (None: the recurrence's zeros)."""

    orig: Callable[..., Any]
    time_args: tuple[int, ...]
    state_arg: int
    segments: list[list[Any]]
    kwargs: dict[str, Any]
    state: mx.array | None

    def after(self, n: int, row: int | None = None) -> mx.array:
        """The state after the first `n` segments (lazy): the batch's, or row `row`'s alone
        (a batch row by itself: every other argument is a weight, without a batch axis)."""
        state = self.state
        if row is not None and state is not None:
            state = state[row:row + 1]
        for seg in self.segments[:n]:
            args = list(seg)
            if row is not None:
                for i in self.time_args:
                    args[i] = args[i][row:row + 1]
            args[self.state_arg] = state
            _, state = self.orig(*args, **self.kwargs)
        assert state is not None
        return state


@dataclass
class _Leaf:
    convs: list[tuple[mx.array, int]]   # per convolution before the recurrence: input, width
    recurrence: int | None              # the recurrence's index among the tapped ones


class Captured:
    """The leaves `indices` of a tapped pass's cache as a cut at each offset would have left
    them: `get(offset)` (of one batch row: `get(offset, row)`)."""

    def __init__(self, offsets: tuple[int, ...], states: list[list[mx.array]],
                 replays: list[Replay], arrays_leaves: dict[int, _Leaf],
                 windows: dict[int, snapshot.Snapshot]) -> None:
        self.offsets = offsets
        self._states, self._replays = states, replays
        self._leaves, self._windows = arrays_leaves, windows
        # kept: built once, evaluated with the pass (`arrays`)
        self._kept = {r: self._build(r, None) for r in offsets} if not replays else {}

    @classmethod
    def build(cls, record: Any, cache: list[Any], indices: tuple[int, ...]
              ) -> tuple[Captured | None, str | None]:
        """From a tap's record (`tap.Tap`): the capture, or None and why it cannot be built."""
        all_leaves = snapshot.leaves(cache)
        leaves: dict[int, _Leaf] = {}
        windows: dict[int, snapshot.Snapshot] = {r: {} for r in record.offsets}
        tapped = len(record.replays) if record.replays else len(record.states)
        recurrent = convs = 0
        for i in indices:
            leaf = all_leaves[i]
            if type(leaf) is ArraysCache:
                # [conv..., state]: a recurrence after its short convolutions, one (Gated
                # DeltaNet, Mamba) or one each for q, k and v (Kimi Linear, OLMo hybrid);
                # or [conv] alone (LFM2's short-convolution layers)
                with_state = len(leaf.cache) > 1
                n = len(leaf.cache) - with_state
                if convs + n > len(record.convs) or (with_state and recurrent >= tapped):
                    return None, "fewer tapped recurrences than recurrent caches"
                leaves[i] = _Leaf(record.convs[convs:convs + n], recurrent if with_state else None)
                convs += n
                recurrent += with_state
            elif type(leaf) is RotatingKVCache:
                why = _window(leaf, i, record.length, windows)
                if why:
                    return None, why
            else:
                return None, f"no in-pass capture for {type(leaf).__name__}"
        if recurrent != tapped or convs != len(record.convs):
            return None, (f"{tapped} recurrences and {len(record.convs)} convolutions tapped "
                          f"for {recurrent} recurrent and {convs} convolution caches")
        return cls(record.offsets, record.states, record.replays, leaves, windows), None

    @property
    def replayed(self) -> bool:
        return bool(self._replays)

    def get(self, r: int, row: int | None = None) -> snapshot.Snapshot:
        """The captured leaves at offset `r` ({} for another position): of the pass's batch,
        or row `row`'s (a batch of one). Replayed states are computed here (lazy)."""
        if r not in self.offsets:
            return {}
        if not self.replayed:
            snap = self._kept[r]
            if row is None:
                return snap
            return {i: ArraysCache.from_state(([c[row:row + 1] for c in leaf.cache], None, None))
                    for i, leaf in snap.items() if i in self._leaves}
        return self._build(r, row)

    def arrays(self) -> list[Any]:
        """Everything to evaluate with the pass (one sync): the kept states (nothing when
        replayed: those are computed only where asked for)."""
        return [leaf.state for snap in self._kept.values() for leaf in snap.values()]

    def _build(self, r: int, row: int | None) -> snapshot.Snapshot:
        j = self.offsets.index(r)
        rows = slice(None) if row is None else slice(row, row + 1)
        out: snapshot.Snapshot = {} if row is not None else dict(self._windows[r])
        for i, leaf in self._leaves.items():
            # copies: each x is pass-sized
            arrays = [mx.contiguous(x[rows, r:r + k - 1, :]) for x, k in leaf.convs]
            if leaf.recurrence is not None:
                if self._replays:
                    arrays.append(self._replays[leaf.recurrence].after(j + 1, row))
                else:
                    arrays.append(self._states[leaf.recurrence][j][rows])
            out[i] = ArraysCache.from_state((arrays, None, None))
        return out


def _window(leaf: RotatingKVCache, i: int, length: int,
            out: dict[int, snapshot.Snapshot]) -> str | None:
    """A sliding window's leaf at each offset of a pass of `length` tokens: views of (or the
    kept rows and a view of) the buffer the pass left, in temporal order."""
    keys, values, offset, keep, max_size, idx = leaf.state
    kept = keys.shape[2] - length   # rows before the pass
    if idx != keys.shape[2] or kept < 0:
        return "sliding window not in temporal order after the pass"
    for r in out:
        out[r][i] = RotatingKVCache.from_state(
            (*_last_window(keys, values, kept + r, keep, max_size),
             offset - length + r, keep, max_size, min(kept + r, max_size)))
    return None


def _last_window(keys: mx.array, values: mx.array, n: int, keep: int,
                 max_size: int) -> tuple[mx.array, mx.array]:
    """The window a cut after the first `n` rows of a pass's buffer leaves, as the cache keeps
    it once it trims: those rows if they fit, else the `keep` first and the last rows, `max_size`
    in all (the window the next token sees is the last `max_size - 1` and itself)."""
    if n <= max_size:
        return keys[..., :n, :], values[..., :n, :]
    if not keep:  # a view of the pass's buffer, as the live cache's own rows are
        return keys[..., n - max_size:n, :], values[..., n - max_size:n, :]
    tail = slice(n - max_size + keep, n)
    return (mx.concatenate([keys[..., :keep, :], keys[..., tail, :]], axis=2),
            mx.concatenate([values[..., :keep, :], values[..., tail, :]], axis=2))


@dataclass(frozen=True)
class RowOf:
    """One row of a batch's capture, as a run's own cache would hold it (what a run that
    decoded in the batch goes back to once it left: `Speculation.go_back`)."""

    captured: Captured
    row: int

    @property
    def replayed(self) -> bool:
        return self.captured.replayed

    def get(self, r: int) -> snapshot.Snapshot:
        return self.captured.get(r, self.row)
