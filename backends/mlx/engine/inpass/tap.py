"""In-pass checkpoints: the cache state at positions inside one prefill pass, taken from values
the pass computes anyway, so a checkpoint there costs no extra forward pass.

Owns: the hooks on mlx-lm's recurrences (`gated_delta_update`: Qwen3-Next, Qwen3.5, Kimi
Linear, ...; `ssm_update`: Mamba2, Falcon-H1, Nemotron-H, ...; Jamba's `ssm_step`) and on
`nn.Conv1d`, which do
nothing unless a `Tap` is active on the calling thread; how a tapped pass turns what they
recorded, and a sliding window's post-pass buffer, into a checkpoint payload at each offset
(`Tap.payloads`); and `verify`, the start-up check, per model, that a tapped pass gives the
checkpoint a pass cut at that position gives. A model that fails it keeps cutting passes.

Why it is exact. A tapped recurrence runs its time steps in the same segments a pass cut would
make (state chained from one segment to the next), so its state at an offset, and its outputs,
are those of the cut pass. A layer's convolution state after `r` tokens is the `K - 1` inputs
before `r`: rows `r .. r + K - 2` of the padded input it convolves. A sliding window
(`RotatingKVCache`) filled by a multi-token pass holds, in temporal order, the old rows it kept
(fixed before the pass) followed by the pass's rows, so the window a cut at `r` would have left
is a prefix of that buffer. Attention KV is never snapshotted (the entry's KV trims to `r`).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.inpass.captured import Captured, Replay

log = logging.getLogger("prefixd.worker.cache")
_local = threading.local()


@dataclass(frozen=True)
class _Spec:
    """Where a recurrence function takes its per-time-step inputs, its state and its mask."""

    time_args: tuple[int, ...]   # positional args with time on axis 1
    state: int                   # positional index of the state
    masks: tuple[int, ...]       # positional indices that must be None (no batch padding)
    mask_names: tuple[str, ...] = ("mask",)


# function name -> spec (mlx-lm 0.32: models/gated_delta.py, models/ssm.py)
SPECS = {
    "gated_delta_update": _Spec(time_args=(0, 1, 2, 3, 4), state=7, masks=(8,)),
    "ssm_update": _Spec(time_args=(0, 2, 3, 5), state=7, masks=(9, 10),
                        mask_names=("mask", "lengths")),
}
# (module, class, method) -> spec, `self` the first argument (mlx-lm 0.32: Jamba's Mamba
# layers run their selective scan, projections included, in one method over the time axis)
METHOD_SPECS = {
    ("mlx_lm.models.jamba", "JambaMambaMixer", "ssm_step"): _Spec(time_args=(1,), state=3,
                                                                  masks=()),
}


@dataclass
class Tap:
    """What one tapped pass of `length` tokens records: per recurrent layer (in call order) its
    states after each offset (or, with `replay`, what computes them again: `captured.Replay`),
    per convolution its padded input. `failed` says why the pass's checkpoints cannot be built
    (then none are)."""

    offsets: tuple[int, ...]   # ascending, 0 < offset < length
    length: int
    replay: bool = False       # hold what recomputes the states, not the states (`Replay`)
    states: list[list[mx.array]] = field(default_factory=list)
    replays: list[Replay] = field(default_factory=list)
    convs: list[tuple[mx.array, int]] = field(default_factory=list)
    failed: str | None = None

    def split(self, orig: Callable, spec: _Spec, args: tuple, kwargs: dict) -> Any:
        """Run `orig` over the segments between the offsets, chaining its state."""
        a = list(args)
        if len(a) <= spec.state:
            a += [None] * (spec.state + 1 - len(a))
        state = kwargs.pop("state", a[spec.state])
        masked = [a[i] for i in spec.masks if i < len(a)] + [kwargs.get(n)
                                                             for n in spec.mask_names]
        if any(m is not None for m in masked) or a[spec.time_args[0]].shape[1] != self.length:
            self.failed = self.failed or f"{orig.__name__}: masked or unexpected length"
            a[spec.state] = state
            return orig(*a, **kwargs)
        bounds = [0, *self.offsets, self.length]
        outs, states, segments = [], [], []
        before = state
        for lo, hi in pairwise(bounds):
            seg = list(a)
            for i in spec.time_args:
                seg[i] = a[i][:, lo:hi]
            segments.append(seg)
            seg = list(seg)
            seg[spec.state] = state
            y, state = orig(*seg, **kwargs)
            outs.append(y)
            states.append(state)
        if self.replay:   # the states in between are let go as the pass computes them
            self.replays.append(Replay(orig, spec.time_args, spec.state, segments[:-1],
                                       dict(kwargs), before))
        else:
            self.states.append(states[:-1])
        return mx.concatenate(outs, axis=1), state

    def capture(self, cache: list[Any], indices: tuple[int, ...]) -> Captured | None:
        """The leaves `indices` of `cache` as a cut at each offset would have left them, or
        None with `failed` set."""
        if self.failed:
            return None
        captured, self.failed = Captured.build(self, cache, indices)
        return captured

    def payloads(self, cache: list[Any], indices: tuple[int, ...]) -> dict[int, snapshot.Snapshot]:
        """offset -> checkpoint payload (the leaves `indices` of `cache` as a cut there would
        have left them), or {} with `failed` set."""
        captured = self.capture(cache, indices)
        return {r: captured.get(r) for r in self.offsets} if captured else {}

    def arrays(self, payloads: dict[int, snapshot.Snapshot]) -> list[Any]:
        """Everything to evaluate with the pass (one sync)."""
        return [leaf.state for snap in payloads.values() for leaf in snap.values()]


def active() -> Tap | None:
    return getattr(_local, "tap", None)


@contextmanager
def tapping(tap: Tap | None) -> Iterator[Tap | None]:
    """Make `tap` record the model calls this thread makes inside the block."""
    _local.tap = tap
    try:
        yield tap
    finally:
        _local.tap = None


def _hook_recurrence(orig: Callable, spec: _Spec) -> Callable:
    @functools.wraps(orig)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        tap = active()
        if tap is None:
            return orig(*args, **kwargs)
        return tap.split(orig, spec, args, kwargs)

    hooked.__prefixd_original__ = orig  # type: ignore[attr-defined]  # marks a hook: install() once
    return hooked


def _conv_call(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def hooked(self: nn.Conv1d, x: mx.array) -> mx.array:
        tap = active()
        if tap is not None:
            k = self.weight.shape[1]
            if x.shape[1] != tap.length + k - 1:
                tap.failed = tap.failed or "convolution input of unexpected length"
            tap.convs.append((x, k))
        return orig(self, x)

    hooked.__prefixd_original__ = orig  # type: ignore[attr-defined]  # marks a hook: install() once
    return hooked


_install_lock = threading.Lock()


def install() -> None:
    """Hook the recurrences in every loaded mlx-lm model module (and their source modules, so
    modules imported later get the hook too) and `nn.Conv1d`. Idempotent."""
    with _install_lock:
        if not hasattr(nn.Conv1d.__call__, "__prefixd_original__"):
            # the in-pass tap patches the library (proven equal to unpatched passes: verify())
            nn.Conv1d.__call__ = _conv_call(nn.Conv1d.__call__)  # type: ignore[method-assign]
        for name, mod in list(sys.modules.items()):
            if not name.startswith("mlx_lm.models.") or mod is None:
                continue
            for fn, spec in SPECS.items():
                current = getattr(mod, fn, None)
                if callable(current) and not hasattr(current, "__prefixd_original__"):
                    setattr(mod, fn, _hook_recurrence(current, spec))
        for (module, cls_name, method), spec in METHOD_SPECS.items():
            cls = getattr(sys.modules.get(module), cls_name, None)
            current = getattr(cls, method, None)
            if callable(current) and not hasattr(current, "__prefixd_original__"):
                setattr(cls, method, _hook_recurrence(current, spec))


def verify(model: Any, fresh: Callable[[], list[Any]], indices: tuple[int, ...],
           every_pass: bool = False) -> str | None:
    """Why in-pass checkpoints cannot be trusted for `model`, or None when a tapped pass over a
    short prompt gives, at two offsets, the checkpoints that passes cut there give.
    `every_pass`: run all three forward passes whatever is found on the way (a group's ranks
    meet in each pass, whatever their layers: `probe.group_inpass`)."""
    if not indices and not every_pass:
        return "nothing to snapshot"
    install()
    tokens = [(i * 7919) % 97 + 3 for i in range(24)]
    cuts = (9, 17)
    why: str | None = None
    try:
        tapped_cache = fresh()
        tap = Tap(cuts, len(tokens))
        with tapping(tap):
            model(mx.array(tokens)[None], cache=tapped_cache)
        got = tap.payloads(tapped_cache, indices)
        why = tap.failed
        if why and not every_pass:
            return why
        mx.eval(tap.arrays(got), [leaf.state for leaf in snapshot.leaves(tapped_cache)])
        cut_cache, start = fresh(), 0
        for r in cuts:
            model(mx.array(tokens[start:r])[None], cache=cut_cache)
            snapshot.evaluate(cut_cache)
            want, _ = snapshot.take(cut_cache, indices)
            for i in indices if why is None else ():
                why = _differs(got[r][i].state, want[i].state)
                if why:
                    why = f"leaf {i} at {r}: {why}"
                    if not every_pass:
                        return why
                    break
            start = r
    except Exception as exc:  # an architecture the hooks do not fit
        if every_pass:
            raise            # a group cannot tell how far the other ranks got
        return f"{type(exc).__name__}: {exc}"
    return why


def _differs(a: Any, b: Any) -> str | None:
    if isinstance(a, mx.array) and isinstance(b, mx.array):
        if a.shape != b.shape:
            return f"shape {a.shape} != {b.shape}"
        a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
        scale = float(mx.abs(b32).max()) + 1e-6
        err = float(mx.abs(a32 - b32).max())
        return None if err <= 0.02 * scale else f"max difference {err:.3g} (scale {scale:.3g})"
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return "different structure"
        for x, y in zip(a, b, strict=True):
            why = _differs(x, y)
            if why:
                return why
        return None
    return None if a == b else f"{a!r} != {b!r}"
