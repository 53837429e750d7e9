"""Agreements between the ranks of a group worker (issue 28): the few values each rank computes
from its own layers (a checkpoint's bytes, whether its state trims back, whether its restore
worked) turned into one value every rank uses, so every rank's checkpoint store makes the
decisions the leader's makes and runs the same forward passes.

Owns: `Solo` (one process: every value as it is) and `Ring` (an all-reduce over the group per
value, called at the same point of the same code on every rank: the Engine's steps run in
lockstep, `follower.py`). Nothing here decides policy: `engine.py` asks.
"""

from __future__ import annotations

from typing import Any, cast


class Solo:
    """One process: nothing to agree on."""

    distributed = False
    rank, size = 0, 1

    def max(self, value: int) -> int:
        return value

    def min(self, value: int) -> int:
        return value

    def all(self, value: bool) -> bool:
        return value

    def any(self, value: bool) -> bool:
        return value

    def leader(self, value: int) -> int:
        """The leader's `value` (what it decided), on every rank."""
        return value


class Ring(Solo):
    """Every rank of an MLX distributed group: a value is the group's max / min."""

    distributed = True

    def __init__(self, group: Any) -> None:
        self.group, self.rank, self.size = group, group.rank(), group.size()

    def _reduce(self, value: int, op: str) -> int:
        import mlx.core as mx

        reduce = mx.distributed.all_max if op == "max" else mx.distributed.all_min
        out = reduce(mx.array([value], dtype=mx.int64), group=self.group, stream=mx.cpu)
        return int(cast(int, out.item()))   # an int64 array's one element

    def max(self, value: int) -> int:
        return self._reduce(value, "max")

    def min(self, value: int) -> int:
        return self._reduce(value, "min")

    def all(self, value: bool) -> bool:
        return bool(self._reduce(int(value), "min"))

    def any(self, value: bool) -> bool:
        return bool(self._reduce(int(value), "max"))

    def leader(self, value: int) -> int:
        return self._reduce(value if self.rank == 0 else -1, "max")   # values are >= 0


SOLO = Solo()
