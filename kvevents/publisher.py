"""The publisher's sockets, as vLLM's `ZmqEventPublisher` runs them: a PUB socket sending
`[topic, sequence, payload]` per batch, sequence numbers from 0 without gaps, and an optional
ROUTER replay socket: a client sends an 8-byte big-endian start sequence and gets every
buffered batch from there as `[sequence, payload]` frames, then `[-1, b""]`. The last
`buffer_steps` batches are kept for it.

Bind or connect: an endpoint on `*`, `::`, an address of this machine, `ipc://` or
`inproc://` is bound (the stable side: subscribers connect to it); any other is connected to
(a collector that binds). Sockets live on the publisher's own thread; `publish` only queues.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from urllib.parse import urlsplit

import zmq

from prefixd.kvevents.wire import END_SEQ, MAP, Batch, Event, encode, seq_bytes

log = logging.getLogger("prefixd.kvevents")


def own_address(host: str) -> bool:
    """Whether `host` names this machine (a wildcard, loopback, or one of its addresses)."""
    if host in ("*", "", "::", "0.0.0.0", "localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError:
            return False
    if ip.is_loopback or ip.is_unspecified:
        return True
    try:
        import psutil
        return any(a.address.split("%")[0] == str(ip)
                   for addrs in psutil.net_if_addrs().values() for a in addrs)
    except Exception:
        return False


def binds(endpoint: str) -> bool:
    """Whether the publisher binds `endpoint` (else it connects to it)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = urlsplit(endpoint).hostname or ""
    return "*" in endpoint or own_address(host)


def connect_form(endpoint: str) -> str:
    """Where a subscriber on this machine connects to reach a publisher bound at
    `endpoint` (`tcp://*:5557` -> `tcp://127.0.0.1:5557`)."""
    return endpoint.replace("://*:", "://127.0.0.1:").replace("://0.0.0.0:", "://127.0.0.1:")


class Publisher:
    """One stream: `publish(events)` queues a batch; the thread sends and buffers it."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, encoding: str = MAP, hwm: int = 100_000,
                 rank: int | None = None) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic, self.encoding, self.rank = topic.encode(), encoding, rank
        self._queue: queue.Queue[Batch | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._hwm = hwm
        self.sent = 0                      # batches sent (the next sequence number)
        self._queued = 0                   # batches handed to `publish`
        self._queued_lock = threading.Lock()
        self.replays = 0
        self.last_sent = 0.0               # time.time() of the last send
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="prefixd-kv-events")
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def publish(self, events: Sequence[Event]) -> None:
        if events:
            with self._queued_lock:
                self._queued += 1
                self._queue.put(Batch(time.time(), tuple(events), self.rank))

    def pending(self) -> int:
        """Batches published and not sent yet (the one being sent included: 0 means `sent`
        counts every batch published so far)."""
        return self._queued - self.sent

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (at most `timeout` s), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _open(self, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = ctx.socket(zmq.PUB)
        replay = None
        try:
            pub.set_hwm(self._hwm)
            pub.setsockopt(zmq.LINGER, 500)
            if binds(self.endpoint):
                _bind(pub, self.endpoint)
            else:
                pub.connect(self.endpoint)
            if self.replay_endpoint:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                _bind(replay, self.replay_endpoint)
        except zmq.ZMQError:
            # nothing left open: not the socket, not the port bound before the failing one
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise
        return pub, replay

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        try:
            pub, replay = self._open(ctx)
        except zmq.ZMQError as e:
            self._error = OSError(f"kv events: cannot open {self.endpoint}"
                                  f"{' / ' + self.replay_endpoint if self.replay_endpoint else ''}"
                                  f": {e}")
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._replay(replay)
                try:
                    batch = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                payload = encode(batch, self.encoding)
                seq = self.sent
                try:
                    pub.send_multipart((self.topic, seq_bytes(seq), payload))
                except zmq.ZMQError:
                    log.exception("kv events: sending batch %d failed (kept for replay)", seq)
                self._buffer.append((seq, payload))
                self.sent += 1
                self.last_sent = time.time()
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _replay(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: a replay request of %d frames ignored", len(frames))
            return
        ident, _, start = frames
        first = int.from_bytes(start, "big", signed=True)
        self.replays += 1
        for seq, payload in list(self._buffer):
            if seq >= first:
                sock.send_multipart((ident, b"", seq_bytes(seq), payload))
        sock.send_multipart((ident, b"", END_SEQ, b""))


REBIND_S = 1.0   # how long a bind waits for the port a closed socket of this process held


def _bind(sock: zmq.Socket, endpoint: str) -> None:
    """Bind `sock`; while the port is in use, try again for at most `REBIND_S`: ZMQ closes a
    socket on its I/O thread after `close` returns, so a publisher opened again at once in the
    same process (a restart, a model reloaded) finds its port still held for a moment."""
    deadline = time.monotonic() + REBIND_S
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)
