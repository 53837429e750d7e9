"""The lockstep seam: the one object through which a worker's generation loop sends every
decision it journals and the engine every value it agrees, whatever the worker's shape.

Three forms, one interface:
- `Lockstep` (one process): values are as they are, nothing is journaled, a failure fails the
  job alone (the engine recovers where it can: a lost checkpoint, an uncached reply);
- `Leader` (rank 0 of a group, `group/leader.py` starts it): every decision (a job started, a
  pass's size and stop, the disk writes due, persist) goes to every follower numbered in
  sequence; a failure of any kind ends the group (exit status 3, the supervisor restarts it
  and the requests in flight are sent again); the followers' heartbeats feed its status and
  its watchdog;
- `Follower` (ranks 1..): reads the journal in sequence (a gap or a repeat is a failure),
  answers by the number it answers, sends heartbeats; a failure raises, and the process ends
  with status 3, which ends the leader in turn.

Agreed values (`max`, `min`, `all`, `any`, `leader`) are one all-reduce each over the group,
each carrying its sequence number and kind, so ranks that called different collectives find
out (`LockstepError`) instead of taking each other's values. The engine and cache code call
these and never ask which rank they are; what differs between forms is here alone. `untimed`
says decisions may not depend on time (a group's ranks run the same passes: no timed probes,
no pass paused for a newcomer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

log = logging.getLogger("prefixd.worker.group")

_NONE = -(2**62)  # `leader` from the other ranks (values agreed are > this)
_KINDS = {"max": 1, "min": 2, "all": 3, "any": 4, "leader": 5}


class LockstepError(RuntimeError):
    """The group's ranks parted (a failure on one, collectives or journal out of step)."""


class Lockstep:
    """One process: nothing to agree on, nothing to journal."""

    group: Any = None      # the MLX distributed group (model loading shards by it)
    rank, size = 0, 1
    mode = ""              # how a group's model is split ("pipeline", "tensor"), once loaded
    untimed = False        # a group's decisions may not depend on time (every rank's differs)

    @property
    def shard(self) -> str:
        """What names this rank's share of the model (its disk tier holds only that)."""
        return ""

    # --- agreed values ----------------------------------------------------------------------
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

    def local_failure(self) -> None:
        """Called in an `except` block where one process recovers alone (a checkpoint lost, a
        reply not cached): returns here; in a group the ranks' stores would part, so it
        raises `LockstepError` from the exception being handled."""

    # --- journaled decisions ----------------------------------------------------------------
    def journal(self, record: dict[str, Any]) -> None:
        """A decision every rank must take as this one does (a follower reads it in order):
        a typed record of the scheduler's, encoded as a JSON-able dict (`scheduler/journal.py`);
        the group carries it as it is and only numbers it."""

    def failed(self, why: str) -> None:
        """A job's step failed: one process fails that job alone (this returns); a group's
        current work ends on every rank (this does not return)."""

    def persist(self, local: Callable[[float], bool], timeout: float) -> bool:
        """At shutdown: `local(timeout)` writes this rank's disk tier; a leader has every rank
        do it and waits for all (True when every rank wrote everything)."""
        return bool(local(timeout))

    def ranks(self) -> list[dict[str, Any]]:
        """The followers as last heard (status; never waits on them)."""
        return []

    def arm(self) -> None:
        """The model is loaded: from now on a rank that goes silent ends the group."""

    def close(self) -> None:
        """Stop the group (a leader: after every rank persisted)."""


class Collectives(Lockstep):
    """Agreed values over an MLX group, sequence-numbered."""

    untimed = True

    def __init__(self, group: Any) -> None:
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.collectives = 0

    @property
    def shard(self) -> str:
        return f":rank{self.rank}of{self.size}:{self.mode}"

    def _agree(self, kind: str, value: int) -> int:
        """One all-max over [seq, -seq, kind, -kind, value]: every rank must be at the same
        collective (same number, same kind), else the group has parted."""
        import mlx.core as mx

        self.collectives += 1
        seq, code = self.collectives, _KINDS[kind]
        out = mx.distributed.all_max(mx.array([seq, -seq, code, -code, value], dtype=mx.int64),
                                     group=self.group, stream=mx.cpu).tolist()
        got = cast(list[int], out)
        if got[0] != -got[1] or got[2] != -got[3]:
            raise LockstepError(f"rank {self.rank}: collective {seq} ({kind}) met collectives "
                                f"{-got[1]}..{got[0]} of other kinds on other ranks")
        return got[4]

    def max(self, value: int) -> int:
        return self._agree("max", value)

    def min(self, value: int) -> int:
        return -self._agree("min", -value)

    def all(self, value: bool) -> bool:
        return not self._agree("all", int(not value))

    def any(self, value: bool) -> bool:
        return bool(self._agree("any", int(value)))

    def leader(self, value: int) -> int:
        return self._agree("leader", value if self.rank == 0 else _NONE)

    def local_failure(self) -> None:
        raise LockstepError("a rank's store would part from the others'")
