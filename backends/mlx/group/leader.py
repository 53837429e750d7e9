"""The lockstep's leader form: rank 0 of a group worker (`lockstep.py` has the interface).

Owns: the journal's sequence numbers, the followers' answers (matched by the number they
answer) and their heartbeats (their status, and the watchdog's evidence), and the group's end.
Every decision the generation loop takes goes to every follower in order (`journal`). A
failure anywhere ends the group: a failed step here, a follower's channel closing (it failed,
or died), a follower silent for `watchdog_s` (stopped, hung): the followers are stopped and
this process exits with status 3 before anything answers a client, so the supervisor restarts
the group as one unit and sends the requests in flight again. An orderly stop has every rank
persist first (`persist`), then ends the followers (`close`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from prefixd.backends.mlx.group.control import Channel, GroupError
from prefixd.backends.mlx.group.lockstep import Collectives
from prefixd.backends.mlx.group.start import Start

log = logging.getLogger("prefixd.worker.group")

FAILED_STATUS = 3   # the group is broken: the supervisor restarts it as one
FAIL_GRACE_S = 0.5  # a broken group's followers: `exit`, then SIGKILL after this


class Leader(Collectives):
    """Rank 0: the group started, its journal, its watchdog."""

    def __init__(self, hosts: list[str], argv: list[str], watchdog_s: float) -> None:
        self.processes = Start(hosts, argv)
        super().__init__(self.processes.start())
        self.watchdog_s = watchdog_s
        self.channels: list[Channel] = self.processes.channels
        self.sent = 0                          # the journal's last sequence number
        self.heard = [time.monotonic()] * len(self.channels)   # each follower, last heard
        self.beats: list[dict[str, Any]] = [{} for _ in self.channels]
        self.answers: list[dict[int, dict[str, Any]]] = [{} for _ in self.channels]
        self.closing, self.armed = False, False
        self._lock = threading.Condition()     # answers, beats, last heard (never held long)
        self._sending = threading.Lock()       # the journal's order (may wait on a socket)
        for rank, channel in enumerate(self.channels, start=1):
            threading.Thread(target=self._watch, args=(rank, channel), daemon=True,
                             name=f"prefixd-rank{rank}").start()
        threading.Thread(target=self._watchdog, daemon=True, name="prefixd-watchdog").start()

    # --- the journal ------------------------------------------------------------------------
    def journal(self, record: dict[str, Any]) -> None:
        self._send(record)

    def _send(self, record: dict[str, Any]) -> int:
        with self._sending:
            self.sent += 1
            message = {**record, "seq": self.sent}
            try:
                for channel in self.channels:
                    channel.send(message)
            except OSError as e:
                self.fail(f"a follower's channel broke ({e})")
            return self.sent

    def _answers(self, seq: int, timeout: float) -> list[dict[str, Any]] | None:
        """Every follower's answer to journal entry `seq` (by its number), or None if one did
        not answer in `timeout` s (a late answer is dropped, not taken for a later one)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not all(seq in got for got in self.answers):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(left)
            return [got.pop(seq) for got in self.answers]

    # --- failures ---------------------------------------------------------------------------
    def failed(self, why: str) -> NoReturn:
        self.fail(f"a step failed on the leader ({why})")

    def fail(self, why: str) -> NoReturn:
        """The group is broken: stop the followers and end this process (status 3) before
        anything answers a client. Never returns."""
        log.error("worker: %s; stopping the group so it can be restarted as one", why)
        self.closing = True
        self.processes.stop(grace=FAIL_GRACE_S)   # nothing of theirs is worth waiting for
        logging.shutdown()
        os._exit(FAILED_STATUS)

    def arm(self) -> None:
        with self._lock:
            self.heard = [time.monotonic()] * len(self.channels)
            self.armed = True

    def _watch(self, rank: int, channel: Channel) -> None:
        """A follower's frames: heartbeats and answers. Its channel closing ends the group."""
        try:
            while True:
                message = channel.recv(timeout=None)
                with self._lock:
                    self.heard[rank - 1] = time.monotonic()
                    if message.get("op") == "beat":
                        self.beats[rank - 1] = message
                    elif isinstance(message.get("seq"), int):
                        self.answers[rank - 1][message["seq"]] = message
                        self._lock.notify_all()
        except (EOFError, OSError, GroupError, ValueError) as e:
            if not self.closing:
                self.fail(f"rank {rank} of the group is gone ({e})")

    def _watchdog(self) -> None:
        """A follower not heard from for `watchdog_s` (a heartbeat every watchdog/5 s from its
        own thread) is stopped or hung: the group ends."""
        while not self.closing:
            time.sleep(min(1.0, self.watchdog_s / 5))
            with self._lock:
                now = time.monotonic()
                silent = [(r, now - t) for r, t in enumerate(self.heard, start=1)
                          if self.armed and now - t > self.watchdog_s]
            if silent and not self.closing:
                rank, quiet = silent[0]
                self.fail(f"rank {rank} of the group sent nothing for {quiet:.1f}s (stopped "
                          f"or hung; the watchdog's bound is {self.watchdog_s:g}s)")

    # --- the end ----------------------------------------------------------------------------
    def persist(self, local: Callable[[float], bool], timeout: float) -> bool:
        """Every rank writes what its disk tier lacks, at once; True if all wrote it all."""
        seq = self._send({"op": "persist", "timeout": timeout})
        done = bool(local(timeout))
        answers = self._answers(seq, timeout + 5)
        return done and answers is not None and all(a.get("done") for a in answers)

    def ranks(self) -> list[dict[str, Any]]:
        with self._lock:
            beats = list(self.beats)
        keep = ("memory", "cache_bytes", "jobs")
        return [{**rank, **{k: beat[k] for k in keep if k in beat}}
                for rank, beat in zip(self.processes.ranks(), beats, strict=False)]

    def close(self) -> None:
        self.closing = True
        self.processes.stop()
