"""The lockstep's follower form: ranks 1.. of a group worker (`lockstep.py` has the interface).

Owns: this rank's end of the control channel once the group has joined: the journal read in
sequence (`next`: a number out of order is a failure, the channel closing is the leader gone),
its answers (`answer`, carrying the number they answer), and its heartbeats, sent from their
own thread every watchdog/5 s (at most 1 s) with this rank's status, so the leader's status page
never waits on a rank and its watchdog hears a rank that a long pass keeps busy. A failure
here raises (`LockstepError`): the process exits with status 3 and its channel closes, which
ends the leader, so the group restarts as one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from prefixd.backends.mlx.group.control import Channel
from prefixd.backends.mlx.group.lockstep import Collectives, LockstepError

log = logging.getLogger("prefixd.worker.group")


class Follower(Collectives):
    """A follower rank: the leader's journal in, answers and heartbeats out."""

    def __init__(self, group: Any, channel: Channel, watchdog_s: float) -> None:
        super().__init__(group)
        self.channel, self.done = channel, 0    # the last journal entry taken
        self.status: Callable[[], dict[str, Any]] = dict
        self._stop = threading.Event()
        self._period = min(1.0, watchdog_s / 5)
        threading.Thread(target=self._beat, daemon=True, name="prefixd-beat").start()

    def next(self) -> dict[str, Any]:
        """The journal's next entry (EOFError once the leader is gone)."""
        message = self.channel.recv(timeout=None)
        seq = message.get("seq")
        if message.get("op") != "exit" and seq != self.done + 1:
            raise LockstepError(f"rank {self.rank}: journal entry {seq} after {self.done}")
        self.done = seq if isinstance(seq, int) else self.done
        return message

    def answer(self, payload: dict[str, Any]) -> None:
        """This rank's answer to the entry just taken (the leader matches it by number)."""
        self.channel.send({**payload, "seq": self.done})

    def failed(self, why: str) -> NoReturn:
        raise LockstepError(f"rank {self.rank}: a step failed ({why})")

    def beat(self) -> None:
        """One heartbeat now, with this rank's status (from the beat thread, and once when
        the rank is ready, so the leader's status has it from the first request)."""
        try:
            status = self.status()
        except Exception:   # a status read failed: the beat still goes
            log.exception("worker: rank %d: status for the heartbeat failed", self.rank)
            status = {}
        self.channel.send({"op": "beat", "done": self.done, **status})

    def _beat(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.beat()
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self.channel.close()
