"""A group's control channel (`group/start.py`): length-prefixed JSON frames over TCP, and the join
that admits only the followers the leader started.

Owns: `Channel` (frames with a size limit checked before anything is read into memory), the
leader's `admit` and the follower's `connect`. Admission is a challenge: the leader sends a
fresh nonce, a follower answers with its rank and an HMAC of the nonce under the start's secret
(and a nonce of its own, which the leader answers the same way, so the follower knows its
leader too). Until every follower is in, `admit` serves every connection at once without
blocking on any: one that sends anything else (an HTTP request, a huge length, garbage, a
wrong MAC), closes, or stays silent past HANDSHAKE_S is dropped and logged, and the join goes
on until the followers are in or its deadline passes.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("prefixd.worker.group")

MAX_FRAME = 64 << 20    # a journal entry (a job's prompt tokens)
HELLO_MAX = 1024        # a frame of the join (its nonces and MACs are ~200 bytes)
HANDSHAKE_S = 10.0      # a connection must prove itself within this (a follower: milliseconds)
MAX_PENDING = 256       # connections proving themselves at once; beyond, the oldest is dropped


class GroupError(RuntimeError):
    """The group could not start, or a rank is gone."""


def frame(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack("<I", len(data)) + data


def parse(data: bytes) -> dict[str, Any]:
    """A frame's body; GroupError unless it is a JSON object."""
    try:
        message = json.loads(data)
    except (ValueError, RecursionError):    # not UTF-8 / JSON, or nested past the stack
        raise GroupError("control frame is not JSON") from None
    if not isinstance(message, dict):
        raise GroupError("control frame is not an object")
    return message


class Channel:
    """One TCP connection carrying length-prefixed JSON frames."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sending = threading.Lock()   # whole frames (a follower's beats beside answers)

    def send(self, message: dict[str, Any]) -> None:
        data = frame(message)
        with self._sending:
            self.sock.sendall(data)

    def send_now(self, message: dict[str, Any]) -> None:
        """Best effort, never waiting more than a second (at the group's end: the peer may be
        stopped, its buffer full, another thread inside `send`)."""
        if self._sending.acquire(timeout=1.0):
            try:
                with contextlib.suppress(OSError):
                    self.sock.send(frame(message), socket.MSG_DONTWAIT)
            finally:
                self._sending.release()

    def recv(self, limit: int = MAX_FRAME, timeout: float | None = None) -> dict[str, Any]:
        """The next frame (GroupError if it is longer than `limit`; TimeoutError, as
        `socket.timeout`, past `timeout` seconds; EOFError once the peer closed)."""
        self.sock.settimeout(timeout)
        (size,) = struct.unpack("<I", self._exact(4))
        if size > limit:
            raise GroupError(f"control frame of {size} bytes")
        return parse(self._exact(size))

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


def mac(secret: str, *parts: object) -> str:
    return hmac.new(secret.encode(), ":".join(map(str, parts)).encode(),
                    hashlib.sha256).hexdigest()


class _Caller:
    """A connection proving itself: the leader's nonce sent, the hello frame read so far."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self.nonce = secrets.token_hex(16)
        self.expires = time.monotonic() + HANDSHAKE_S
        self.data = bytearray()

    def hello(self) -> dict[str, Any] | None:
        """The hello once whole (None while it is not); GroupError if it cannot be one."""
        if len(self.data) >= 4:
            (size,) = struct.unpack("<I", self.data[:4])
            if size > HELLO_MAX:         # decided from the prefix: nothing more is read
                raise GroupError(f"a frame of {size} bytes")
            if len(self.data) >= 4 + size:
                return parse(bytes(self.data[4:4 + size]))
        return None


def admit(listener: socket.socket, secret: str, ranks: int, deadline: float,
          check: Callable[[], None]) -> list[Channel]:
    """The followers' channels, ranks 1..ranks-1 in order, once each has proven itself; every
    other connection is dropped. `check` raises if the group cannot complete (a follower
    exited); GroupError at `deadline`."""
    found: dict[int, Channel] = {}
    callers: dict[socket.socket, _Caller] = {}
    listener.setblocking(False)
    with selectors.DefaultSelector() as sel:
        sel.register(listener, selectors.EVENT_READ)

        def drop(caller: _Caller, why: str) -> None:
            log.warning("worker: dropped a control connection from %s (%s); the join goes on",
                        caller.peer, why)
            sel.unregister(caller.sock)
            del callers[caller.sock]
            with contextlib.suppress(OSError):
                caller.sock.close()

        try:
            while len(found) < ranks - 1:
                now = time.monotonic()
                if now >= deadline:
                    raise GroupError(f"ranks {sorted(set(range(1, ranks)) - set(found))} "
                                     "did not join the control channel in time")
                check()
                for caller in [c for c in callers.values() if c.expires <= now]:
                    drop(caller, "silent")
                soonest = min([deadline, now + 0.5, *(c.expires for c in callers.values())])
                for key, _ in sel.select(max(0.0, soonest - now)):
                    if key.fileobj is listener:
                        for caller in _accept(listener):
                            if len(callers) >= MAX_PENDING:     # the oldest goes: a real
                                drop(min(callers.values(), key=lambda c: c.expires),
                                     "crowded out")            # follower answers at once
                            callers[caller.sock] = caller
                            sel.register(caller.sock, selectors.EVENT_READ)
                        continue
                    caller = callers[key.fileobj]   # type: ignore[index]
                    try:
                        chunk = caller.sock.recv(HELLO_MAX + 4 - len(caller.data))
                        if not chunk:
                            raise GroupError("closed")
                        caller.data += chunk
                        hello = caller.hello()
                        if hello is None:
                            continue
                        rank = _proven(hello, caller.nonce, secret, ranks)
                        sel.unregister(caller.sock)
                        del callers[caller.sock]
                        caller.sock.settimeout(HANDSHAKE_S)
                        channel = Channel(caller.sock)
                        channel.send({"mac": mac(secret, hello["nonce"], "leader")})
                        if rank in found:    # it connected again: the newest one holds
                            found[rank].close()
                        found[rank] = channel
                    except (GroupError, OSError) as e:
                        if caller.sock in callers:
                            drop(caller, str(e) or type(e).__name__)
        except BaseException:
            for channel in found.values():
                channel.close()
            raise
        finally:
            for caller in list(callers.values()):
                with contextlib.suppress(OSError):
                    caller.sock.close()
    return [found[r] for r in sorted(found)]


def _accept(listener: socket.socket) -> list[_Caller]:
    """Every connection waiting, each sent its challenge (none waits for another)."""
    out: list[_Caller] = []
    while True:
        try:
            sock, addr = listener.accept()
        except OSError:         # none waiting (or one reset first, or out of files): later
            return out
        caller = _Caller(sock, f"{addr[0]}:{addr[1]}")
        try:
            sock.setblocking(False)
            sock.send(frame({"nonce": caller.nonce}))   # ~50 bytes: an empty buffer takes it
        except OSError:
            sock.close()
            continue
        out.append(caller)


def _proven(hello: dict[str, Any], nonce: str, secret: str, ranks: int) -> int:
    """The rank a hello proves (GroupError unless its MAC is the secret's)."""
    rank = hello.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 < rank < ranks or \
            not isinstance(hello.get("nonce"), str) or \
            not hmac.compare_digest(str(hello.get("mac")), mac(secret, nonce, rank)):
        raise GroupError("not one of the group's followers")
    return rank


def connect(control: str, secret: str, rank: int, timeout: float) -> Channel:
    """A follower's control channel to its leader, both proven to hold the start's secret;
    tried again (a stray may have crowded it out) until `timeout` seconds have passed."""
    host, port = control.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=HANDSHAKE_S)
            channel = Channel(sock)
            try:
                nonce = channel.recv(HELLO_MAX, HANDSHAKE_S).get("nonce")
                mine = secrets.token_hex(16)
                channel.send({"rank": rank, "mac": mac(secret, nonce, rank), "nonce": mine})
                answer = channel.recv(HELLO_MAX, HANDSHAKE_S)
            except BaseException:
                channel.close()
                raise
            if not hmac.compare_digest(str(answer.get("mac")), mac(secret, mine, "leader")):
                channel.close()
                raise GroupError("the control channel's leader does not hold the secret")
            sock.settimeout(None)
            return channel
        except (OSError, EOFError) as e:
            if time.monotonic() > deadline:
                raise GroupError(f"could not join the leader at {control}: {e}") from None
            time.sleep(0.05)
