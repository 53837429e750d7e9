"""A worker that spans machines (issue 28): the ranks of one MLX distributed group (its ring
backend). Rank 0, the leader, serves HTTP and decides; the followers run the same forward
passes on their shards of the model (`follower.py`).

Owns: the group's start-up and its end. The leader starts its followers (a loopback host as a
child process; any other host over ssh, with the same interpreter path and the same
conventions as `mlx.launch`), holds their PIDs and stops them; every rank writes the ring's
hostfile and joins the ring; the control channel carries the leader's journal to the
followers (length-prefixed JSON frames over TCP; a follower proves it holds the start's secret
by an HMAC of the leader's nonce) and their answers back. A follower that is gone ends the
leader (exit status 3), so whoever supervises it restarts the group as one unit; a leader
that is gone ends its followers (their channel closes; local ones also follow its PID).
What is journaled is `active.py`'s and `generation.py`'s; what ranks agree on, `agree.py`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import queue
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from prefixd.backends.mlx.agree import Ring

log = logging.getLogger("prefixd.worker.group")

RANK_ENV = "PREFIXD_GROUP_RANK"        # a follower's rank (the leader has none)
RING_ENV = "PREFIXD_GROUP_RING"        # the ring's hostfile, as JSON
CONTROL_ENV = "PREFIXD_GROUP_CONTROL"  # host:port of the leader's control channel
SECRET_ENV = "PREFIXD_GROUP_SECRET"    # the start's secret (proves a follower is ours)
JOIN_TIMEOUT_S = 120.0  # followers connecting to the control channel after the ring is up
MAX_FRAME = 64 << 20


class GroupError(RuntimeError):
    """The group could not start, or a rank is gone."""


class Channel:
    """One TCP connection carrying length-prefixed JSON frames."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        self.sock.sendall(struct.pack("<I", len(data)) + data)

    def recv(self) -> dict[str, Any]:
        (size,) = struct.unpack("<I", self._exact(4))
        if size > MAX_FRAME:
            raise GroupError(f"control frame of {size} bytes")
        message = json.loads(self._exact(size))
        if not isinstance(message, dict):
            raise GroupError("control frame is not an object")
        return message

    def _exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise EOFError("the control channel closed")
            out += chunk
        return bytes(out)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _mac(secret: str, nonce: str) -> str:
    return hmac.new(secret.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def join_ring(ring: str, rank: int) -> Any:
    """Join the ring as `rank` (every rank; the leader first): the hostfile written where this
    process can read it, as the ring backend expects (`MLX_HOSTFILE`, `MLX_RANK`)."""
    import mlx.core as mx

    fd, path = tempfile.mkstemp(prefix="prefixd-ring-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(ring)
        os.environ["MLX_HOSTFILE"], os.environ["MLX_RANK"] = path, str(rank)
        group = mx.distributed.init(backend="ring", strict=True)
    finally:
        os.unlink(path)
    if group.size() != len(json.loads(ring)) or group.rank() != rank:
        raise GroupError(f"joined the ring as rank {group.rank()} of {group.size()}")
    return group


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost; anything else (0.0.0.0, a LAN address) is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Leader:
    """Rank 0: starts the followers, joins the ring, holds the control channel."""

    def __init__(self, hosts: list[str], argv: list[str], ring_port: int) -> None:
        self.hosts, self.argv, self.ring_port = hosts, argv, ring_port
        self.children: list[subprocess.Popen[bytes]] = []
        self.channels: list[Channel] = []
        self.replies: list[queue.Queue[dict[str, Any]]] = []
        self.closing = False
        self._send_lock = threading.Lock()

    def _addresses(self) -> list[str]:
        return [f"127.0.0.1:{_free_port()}" if is_loopback(h) else f"{h}:{self.ring_port + r}"
                for r, h in enumerate(self.hosts)]

    def start(self) -> Ring:
        """Spawn the followers, join the ring, accept their control connections; the group's
        agreement object. Raises GroupError (after stopping what it started) on failure."""
        local = all(is_loopback(h) for h in self.hosts)
        listener = socket.create_server(("127.0.0.1" if local else "0.0.0.0", 0))
        listener.settimeout(JOIN_TIMEOUT_S)
        secret, ring = secrets.token_hex(16), json.dumps([[a] for a in self._addresses()])
        control = f"{'127.0.0.1' if local else self.hosts[0]}:{listener.getsockname()[1]}"
        try:
            for rank in range(1, len(self.hosts)):
                self._spawn(rank, {RANK_ENV: str(rank), RING_ENV: ring, CONTROL_ENV: control,
                                   SECRET_ENV: secret})
            t0 = time.monotonic()
            group = join_ring(ring, 0)
            log.info("worker: group of %d ranks joined in %.2fs (%s)", group.size(),
                     time.monotonic() - t0, ", ".join(self.hosts))
            self._accept(listener, secret)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        return Ring(group)

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

    def _accept(self, listener: socket.socket, secret: str) -> None:
        found: dict[int, Channel] = {}
        while len(found) < len(self.hosts) - 1:
            sock, _ = listener.accept()
            sock.settimeout(JOIN_TIMEOUT_S)
            channel, nonce = Channel(sock), secrets.token_hex(16)
            channel.send({"nonce": nonce})
            hello = channel.recv()
            rank = hello.get("rank")
            if not isinstance(rank, int) or not 0 < rank < len(self.hosts) or rank in found or \
                    not hmac.compare_digest(str(hello.get("mac")), _mac(secret, nonce)):
                log.warning("worker: refused a control connection (%r)", hello.get("rank"))
                channel.close()
                continue
            sock.settimeout(None)
            found[rank] = channel
        self.channels = [found[r] for r in sorted(found)]
        self.replies = [queue.Queue() for _ in self.channels]
        for rank, (channel, replies) in enumerate(zip(self.channels, self.replies,
                                                      strict=True), start=1):
            threading.Thread(target=self._watch, args=(rank, channel, replies), daemon=True,
                             name=f"prefixd-rank{rank}").start()

    def _watch(self, rank: int, channel: Channel, replies: queue.Queue[dict[str, Any]]) -> None:
        """A follower's answers; its channel closing ends the leader (unless it is closing)."""
        try:
            while True:
                replies.put(channel.recv())
        except (EOFError, OSError, GroupError, ValueError) as e:
            if not self.closing:
                self.fail(f"rank {rank} of the group is gone ({e})")

    def fail(self, why: str) -> None:
        """The group is broken: stop the followers and end this process (status 3) before
        anything answers a client, so the supervisor restarts the group as one unit and sends
        the requests in flight again. Never returns."""
        log.error("worker: %s; stopping the group so it can be restarted as one", why)
        self.close()
        logging.shutdown()
        os._exit(3)

    def send(self, message: dict[str, Any]) -> None:
        """A journal entry to every follower (in order; they run it as they get it)."""
        with self._send_lock:
            for channel in self.channels:
                channel.send(message)

    def ask(self, message: dict[str, Any], timeout: float = 30.0) -> list[dict[str, Any]]:
        """`send`, then every follower's answer (in rank order)."""
        self.send(message)
        return self.answers(timeout)

    def answers(self, timeout: float) -> list[dict[str, Any]]:
        """Every follower's answer to what was sent last (in rank order)."""
        return [q.get(timeout=timeout) for q in self.replies]

    def close(self) -> None:
        """Stop the followers (by PID: SIGTERM, then SIGKILL after 5 s)."""
        self.closing = True
        for channel in self.channels:
            with contextlib.suppress(OSError):
                channel.send({"op": "exit"})
            channel.close()
        deadline = time.monotonic() + 5.0
        for child in self.children:
            if child.poll() is None:
                child.terminate()
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


def connect(control: str, secret: str, rank: int) -> Channel:
    """A follower's control channel to its leader (retried until JOIN_TIMEOUT_S)."""
    host, port = control.rsplit(":", 1)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=JOIN_TIMEOUT_S)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    channel = Channel(sock)
    nonce = channel.recv().get("nonce")
    channel.send({"rank": rank, "mac": _mac(secret, str(nonce))})
    sock.settimeout(None)
    return channel
