"""A worker that spans machines (issue 28): the ranks of one MLX distributed group (its ring
backend). Rank 0, the leader, serves HTTP and decides; the followers run the same forward
passes on their shards of the model (`scheduler/replay.py`).

Owns: the group's processes, their start-up and their end. The leader starts its followers (a
loopback host as a child process; any other host over ssh, with the same interpreter path and the
same conventions as `mlx.launch`), holds their PIDs and stops them. The join has two steps: the
followers prove they hold the start's secret on the control channel (`group/control.py`: whatever
else connects is dropped and the join goes on), then every rank joins the ring on ports chosen only
then and told only over that channel, again until the ring is whole (`group/ring.py`). The control
channel then carries the leader's journal to the followers and their answers and heartbeats back
(`leader.py`, `follower.py`: the lockstep's two group forms). A leader that is gone ends its
followers (their channel closes; local ones also follow its PID).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from typing import Any

from prefixd.backends.mlx.group.control import Channel, GroupError, admit
from prefixd.backends.mlx.group.ring import form

log = logging.getLogger("prefixd.worker.group")

RANK_ENV = "PREFIXD_GROUP_RANK"        # a follower's rank (the leader has none)
CONTROL_ENV = "PREFIXD_GROUP_CONTROL"  # host:port of the leader's control channel
SECRET_ENV = "PREFIXD_GROUP_SECRET"    # the start's secret (proves a follower is ours)
JOIN_TIMEOUT_S = 120.0  # followers started and admitted to the control channel
RING_TIMEOUT_S = 180.0  # then the ring joined (an attempt a stray spoiled costs MLX ~31 s)

__all__ = ["CONTROL_ENV", "JOIN_TIMEOUT_S", "RANK_ENV", "SECRET_ENV", "Channel", "GroupError",
           "Start", "is_loopback"]


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost; anything else (0.0.0.0, a LAN address) is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Start:
    """Rank 0's processes: starts the followers, joins the ring, stops them."""

    def __init__(self, hosts: list[str], argv: list[str]) -> None:
        self.hosts, self.argv = hosts, argv
        self.children: list[subprocess.Popen[bytes]] = []
        self.channels: list[Channel] = []

    def start(self) -> Any:
        """Spawn the followers, admit them to the control channel (on this host's address
        only, never 0.0.0.0), join the ring with them; the MLX group. Strays at either port are
        dropped and the join goes on (`group/control.py`, `group/ring.py`). Raises GroupError (after
        stopping what it started) once the join cannot complete."""
        here = ["127.0.0.1" if is_loopback(h) else h for h in self.hosts]
        listener = socket.create_server((here[0], 0))
        secret = secrets.token_hex(16)
        control = f"{here[0]}:{listener.getsockname()[1]}"
        try:
            for rank in range(1, len(self.hosts)):
                self._spawn(rank, {RANK_ENV: str(rank), CONTROL_ENV: control,
                                   SECRET_ENV: secret})
            t0 = time.monotonic()
            self.channels = admit(listener, secret, len(self.hosts), t0 + JOIN_TIMEOUT_S,
                                  self._check)
            listener.close()
            group = form(self.channels, here, time.monotonic() + RING_TIMEOUT_S, self._check)
            log.info("worker: group of %d ranks joined in %.2fs (%s)", group.size(),
                     time.monotonic() - t0, ", ".join(self.hosts))
        except BaseException:
            self.stop()
            raise
        finally:
            listener.close()
        return group

    def _check(self) -> None:
        """GroupError if a follower has exited (the join cannot complete)."""
        for rank, child in enumerate(self.children, start=1):
            if child.poll() is not None:
                raise GroupError(f"rank {rank} exited (status {child.returncode}) during "
                                 "the join")

    def _spawn(self, rank: int, group_env: dict[str, str]) -> None:
        host = self.hosts[rank]
        command = [sys.executable, "-m", "prefixd.backends.mlx", *self.argv]
        env = {**os.environ, **group_env, "PREFIXD_PARENT_PID": str(os.getpid())}
        if not is_loopback(host):       # as mlx.launch: ssh, the same interpreter path there
            exports = [f"{k}={v}" for k, v in env.items() if k.startswith(("PREFIXD_", "MLX_"))]
            exports = [e for e in exports if not e.startswith("PREFIXD_PARENT_PID=")]
            command = ["ssh", host, "env", *map(_quote, exports), *map(_quote, command)]
            env = dict(os.environ)
        self.children.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL))
        log.info("worker: started rank %d on %s (pid %d)", rank, host, self.children[-1].pid)

    def stop(self, grace: float = 5.0) -> None:
        """Stop the followers: `exit` on their channels (they act on no signal), then SIGKILL
        by PID to one still there after `grace` s (a stopped or hung one)."""
        for channel in self.channels:
            channel.send_now({"op": "exit"})
            channel.close()
        deadline = time.monotonic() + grace
        for child in self.children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

    def ranks(self) -> list[dict[str, Any]]:
        """Rank 1.. as started: host and PID (the status page's view of the group)."""
        return [{"rank": r, "host": h, "pid": c.pid, "alive": c.poll() is None}
                for r, (h, c) in enumerate(zip(self.hosts[1:], self.children, strict=False),
                                           start=1)]


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)
