"""A group's ring (`group/start.py`): MLX's ring backend joined only between the ranks the control
channel admitted, and joined again until it is.

MLX's ring has no handshake of its own: each rank listens on its address in the hostfile and
takes the first connection it accepts as its left neighbour. So a stray connection that reaches
a rank's ring port before the real neighbour does either makes a rank's join fail (its
neighbour finds the port closed) or becomes that rank's neighbour. Here:

- the ring's ports are chosen for each attempt, after the control channel's join, by each rank
  on its own host (`port`); they travel only over that channel;
- the rank that connects to rank 0 does so only once rank 0 listens (`_await_leader`), so its
  first try gets in and rank 0's port is open for about a millisecond;
- after every rank's attempt, each reports the two ends of its ring connections (`report`), and
  the leader checks that every rank's left connection is its neighbour's right one (`linked`):
  the same TCP connection seen from both ends. A failed or foreign attempt is undone on every
  rank (`discard`: MLX keeps a joined group for the process, so its registry is cleared) and
  the ring is joined again on new ports, until the join's deadline. While the leader judges,
  a follower stands in on its own port (`_stand_in`): a neighbour still retrying it (MLX
  retries a refused connection for ~31 s, its process held meanwhile) gets in and is judged
  at once. A stranger on rank 0's port still costs those ~31 s: rank 0 is the one held.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import itertools
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from prefixd.backends.mlx.group.control import Channel, GroupError

log = logging.getLogger("prefixd.worker.group")

REPORT_MAX = 64 << 10   # a rank's answer during the join (its port, its attempt's report)
LEADER_HEAD_START_S = 0.05  # a remote leader's time to listen before its neighbour connects
_CLEAR = "_ZN3mlx4core11distributed14clear_backendsEv"   # mlx::core::distributed::clear_backends


def port(host: str) -> int:
    """A port free now on `host` (this rank's own address), for this attempt's ring."""
    with socket.socket() as s:          # bound, never listening: nothing can connect to it
        s.bind((host, 0))
        return int(s.getsockname()[1])


def attempt(ring: str, rank: int, first: Callable[[], None] | None = None
            ) -> tuple[Any | None, str | None]:
    """Join `ring` (a hostfile, JSON) as `rank`: (the group, None), or (None, why not).
    `first`: what to wait for once all is ready but the join itself."""
    import mlx.core as mx

    fd, path = tempfile.mkstemp(prefix="prefixd-ring-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(ring)
        os.environ["MLX_HOSTFILE"], os.environ["MLX_RANK"] = path, str(rank)
        if first is not None:
            first()
        group = mx.distributed.init(backend="ring", strict=True)
    except Exception as e:          # a port taken, a neighbour that never came
        return None, str(e) or type(e).__name__
    finally:
        os.unlink(path)
    size = len(json.loads(ring))
    if group.size() != size or group.rank() != rank:
        return group, f"joined as rank {group.rank()} of {group.size()}"
    return group, None


def report(ring: str, rank: int, joined: bool, error: str | None) -> dict[str, Any]:
    """This rank's attempt, as the leader checks it: whether it joined, and the far end of each
    connection accepted on its port (`left`) and the near end of each made to its right
    neighbour's (`right`), as host:port."""
    left, right = [], []
    mine, theirs = _port(ring, rank), _port(ring, (rank + 1) % len(json.loads(ring)))
    if joined:
        for c in psutil.Process().net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN or not c.laddr or not c.raddr:
                continue
            if c.laddr.port == mine:
                left.append(f"{c.raddr.ip}:{c.raddr.port}")
            elif c.raddr.port == theirs:
                right.append(f"{c.laddr.ip}:{c.laddr.port}")
    return {"joined": joined, "error": error, "left": left, "right": right}


def linked(reports: list[dict[str, Any]]) -> str | None:
    """None if every rank joined and each one's left connection is exactly its left
    neighbour's right one (no stranger among them); else what is wrong."""
    failed = [r for r, rep in enumerate(reports) if not rep.get("joined")]
    if failed:
        return "; ".join(f"rank {r}: {reports[r].get('error')}" for r in failed)
    for r, rep in enumerate(reports):
        left, right = rep.get("left"), reports[r - 1].get("right")
        if not isinstance(left, list) or len(left) != 1 or left != right:
            return f"rank {r}'s ring neighbour is {left}, not rank {(r - 1) % len(reports)} " \
                f"({right})"
    return None


def discard() -> None:
    """Undo this process's ring (after a failed attempt), so it can be joined again: MLX
    keeps the first group joined for the process; clearing its registry (what MLX does at
    exit) closes that group's connections once nothing else holds it."""
    gc.collect()                    # the caller has dropped its Group
    import mlx.core as mx

    libs = sorted((Path(mx.__file__).parent / "lib").glob("libmlx.*"))
    try:
        clear = getattr(ctypes.CDLL(str(libs[0])), _CLEAR)
    except (IndexError, OSError, AttributeError) as e:   # another MLX build: no second try
        raise GroupError(f"cannot undo a ring attempt with this MLX ({e})") from None
    clear.restype = None
    clear()


def _port(ring: str, rank: int) -> int:
    address = json.loads(ring)[rank][0]
    return int(str(address).rsplit(":", 1)[1])


def hostfile(addresses: list[str]) -> str:
    return json.dumps([[a] for a in addresses])


def form(channels: list[Channel], hosts: list[str], deadline: float,
         check: Callable[[], None]) -> Any:
    """The leader's side: the ring with the admitted followers (`channels`, ranks 1..), joined
    again on new ports until it is whole; GroupError at `deadline`. `hosts[r]`: the address
    rank r listens on."""
    why = "no attempt"
    for tries in itertools.count(1):
        if time.monotonic() >= deadline:
            raise GroupError(f"the ring did not form in time (last: {why})")
        check()
        try:
            ports = [port(hosts[0])]
            for r, channel in enumerate(channels, start=1):
                channel.send({"op": "port", "host": hosts[r]})
                ports.append(int(channel.recv(REPORT_MAX, _left(deadline))["port"]))
            ring = hostfile([f"{h}:{p}" for h, p in zip(hosts, ports, strict=True)])
            group, why = _lead(channels, ring, deadline)
        except (OSError, EOFError, KeyError, ValueError, TypeError) as e:
            raise GroupError(f"a follower left the ring's join ({e})") from None
        if group is not None:
            log.info("worker: the ring is joined (attempt %d)", tries)
            return group
        log.warning("worker: the ring's attempt %d failed (%s); joining again on new ports",
                    tries, why)
    raise AssertionError("unreachable")


def _lead(channels: list[Channel], ring: str, deadline: float) -> tuple[Any | None, str]:
    """One attempt at rank 0: (the group, "") if every rank's ring is linked to its
    neighbours', else (None, why) with every rank's attempt undone."""
    for channel in channels:
        channel.send({"op": "ring", "ring": ring})
    # MLX's binding holds the GIL until the ring is joined or failed (nothing else in this
    # process runs meanwhile); a neighbour that fails to connect ends it within ~31 s.
    result = list(attempt(ring, 0))
    reports = [report(ring, 0, result[0] is not None and result[1] is None, result[1])]
    reports += [channel.recv(REPORT_MAX, _left(deadline)) for channel in channels]
    why = linked(reports)
    for channel in channels:
        channel.send({"op": "ring_done", "ok": why is None})
    if why is None:
        return result[0], ""
    _undo(result)
    return None, why


def _undo(result: list[Any]) -> None:
    joined = result[0] is not None
    result.clear()
    if joined:
        discard()


def follow(channel: Channel, rank: int) -> Any:
    """A follower's side of `form`: its port when asked, its attempts, the group once the
    leader finds the ring whole. EOFError if the leader stops the group meanwhile."""
    while True:
        message = channel.recv(REPORT_MAX)
        op = message.get("op")
        if op == "exit":
            raise EOFError("the leader stopped the group")
        if op == "port":
            channel.send({"port": port(str(message["host"]))})
            continue
        if op != "ring":
            raise GroupError(f"unexpected {op!r} while joining the ring")
        ring = str(message["ring"])
        last = rank == len(json.loads(ring)) - 1     # the one rank that connects to rank 0
        result = list(attempt(ring, rank, functools.partial(_await_leader, ring) if last
                              else None))
        with _stand_in(ring, rank, result[0] is not None):
            channel.send(report(ring, rank, result[0] is not None and result[1] is None,
                                result[1]))
            done = channel.recv(REPORT_MAX).get("ok") is True
        if done:
            return result[0]
        _undo(result)


@contextlib.contextmanager
def _stand_in(ring: str, rank: int, joined: bool) -> Iterator[None]:
    """While the leader judges the attempt: a listener on this rank's ring port (MLX closed its
    own on its first connection). If that was a stranger's, the left neighbour is still
    retrying the port (MLX: for ~31 s, holding its process): it gets in here at its next try,
    its attempt ends and the leader finds it spoiled in a second or two."""
    if not joined:
        yield
        return
    host = json.loads(ring)[rank][0].rsplit(":", 1)[0]
    with socket.socket() as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, _port(ring, rank)))
            s.listen(16)            # never accepted: the kernel completes the connections
        except OSError:
            pass
        yield


def _await_leader(ring: str) -> None:
    """Give rank 0 (which listens as soon as it has sent the ring) time to listen, so this
    rank's first connection gets in: refused, MLX would wait a second, with rank 0's port
    open to anyone meanwhile. A leader on this machine (our parent) is watched; one
    elsewhere is given LEADER_HEAD_START_S."""
    parent = os.environ.get("PREFIXD_PARENT_PID", "")
    want, deadline = _port(ring, 0), time.monotonic() + 2.0
    try:
        leader = psutil.Process(int(parent))
        while time.monotonic() < deadline:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == want
                   for c in leader.net_connections("tcp")):
                return          # (each look takes about a millisecond: no sleep between)
    except (ValueError, psutil.Error):      # not our parent's to see: over ssh
        time.sleep(LEADER_HEAD_START_S)


def _left(deadline: float) -> float:
    return max(0.01, deadline - time.monotonic())
