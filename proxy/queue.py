"""Per-backend FIFO admission: at most `max_concurrency` requests in flight, at most
`depth` waiting, each waiting at most `timeout_s`.

One `BackendQueue` per backend owns its waiters and its in-flight count; everything runs on
the event loop, so no lock is needed. A waiter that is cancelled (client gone) leaves the
queue and never reaches the backend; a slot granted to a waiter that is cancelled at the
same moment is handed on, so no slot leaks. A request sent again (its backend died before
answering it) waited its turn already: it goes to the head of the queue (`front`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from prefixd.metrics.proxy import IN_FLIGHT, QUEUE_DEPTH, QUEUE_REJECTED, QUEUE_WAIT


class QueueFull(Exception):
    pass


class QueueTimeout(Exception):
    pass


class QueueClosed(Exception):
    pass


RECENT = 100  # requests whose time behind others the status page summarizes

PositionCallback = Callable[[int], Awaitable[None]]


class Slot:
    """One in-flight slot of a queue, held by a request until released (once)."""

    def __init__(self, queue: BackendQueue, waited: float) -> None:
        self.queue, self.waited = queue, waited
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.queue.release()


class BackendQueue:
    def __init__(self, name: str, max_concurrency: int, depth: int, timeout_s: float,
                 heartbeat_s: float = 2.0) -> None:
        self.name = name
        self.max_concurrency = max_concurrency
        self.depth = depth
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._waits: deque[float] = deque(maxlen=RECENT)  # the last requests' time behind others

    def waited(self, seconds: float) -> None:
        """A request served here spent `seconds` behind others (this queue, then the
        backend's own scheduler, as the request's trace adds them up)."""
        self._waits.append(seconds)

    def recent_waits(self) -> dict[str, float | int | None]:
        """The last requests' time behind others, for the status page: median and worst."""
        waits = sorted(self._waits)
        return {"waited_n": len(waits),
                "waited_p50_s": round(waits[len(waits) // 2], 3) if waits else None,
                "waited_max_s": round(waits[-1], 3) if waits else None}

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def full(self) -> bool:
        return len(self._waiters) >= self.depth

    def would_wait(self) -> bool:
        return bool(self._waiters) or self.in_flight >= self.max_concurrency

    def _gauges(self) -> None:
        QUEUE_DEPTH.labels(self.name).set(len(self._waiters))
        IN_FLIGHT.labels(self.name).set(self.in_flight)
        if self.in_flight == 0:
            self._idle.set()
        else:
            self._idle.clear()

    def _grant_next(self) -> None:
        while self._waiters and self.in_flight < self.max_concurrency:
            fut = self._waiters.popleft()
            if not fut.done():
                self.in_flight += 1
                fut.set_result(None)
        self._gauges()

    def position(self, fut: asyncio.Future[None]) -> int:
        try:
            return self._waiters.index(fut) + 1
        except ValueError:
            return 0

    async def _acquire(self, on_position: PositionCallback | None, front: bool) -> None:
        if self._closed:
            raise QueueClosed(self.name)
        if (front or not self._waiters) and self.in_flight < self.max_concurrency:
            self.in_flight += 1
            self._gauges()
            return
        if len(self._waiters) >= self.depth:
            QUEUE_REJECTED.labels(self.name, "full").inc()
            raise QueueFull(self.name)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if front:
            self._waiters.appendleft(fut)
        else:
            self._waiters.append(fut)
        self._gauges()
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                if on_position is not None:
                    await on_position(self.position(fut))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    QUEUE_REJECTED.labels(self.name, "timeout").inc()
                    raise QueueTimeout(self.name)
                step = min(remaining, self.heartbeat_s) if on_position else remaining
                done, _ = await asyncio.wait({fut}, timeout=step)
                if done:
                    fut.result()  # raises QueueClosed if the queue was closed
                    return
        except BaseException as e:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.in_flight -= 1      # granted at the same moment we gave up: pass it on
            else:
                fut.cancel()
                if not isinstance(e, (QueueTimeout, QueueClosed)):
                    QUEUE_REJECTED.labels(self.name, "disconnect").inc()
            with contextlib.suppress(ValueError):
                self._waiters.remove(fut)
            self._grant_next()
            raise

    def release(self) -> None:
        self.in_flight -= 1
        self._grant_next()

    async def acquire(self, on_position: PositionCallback | None = None,
                      front: bool = False) -> Slot:
        """One in-flight slot, held until `Slot.release()`."""
        t0 = time.monotonic()
        await self._acquire(on_position, front)
        waited = time.monotonic() - t0
        QUEUE_WAIT.labels(self.name).observe(waited)
        return Slot(self, waited)

    @asynccontextmanager
    async def slot(self, on_position: PositionCallback | None = None,
                   front: bool = False) -> AsyncIterator[float]:
        """Hold one in-flight slot for the block; yields the seconds spent waiting."""
        held = await self.acquire(on_position, front)
        try:
            yield held.waited
        finally:
            held.release()

    def close(self) -> int:
        """Refuse new requests and fail every waiter with QueueClosed; returns how many."""
        self._closed = True
        n = 0
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(QueueClosed(self.name))
                QUEUE_REJECTED.labels(self.name, "shutdown").inc()
                n += 1
        self._gauges()
        return n

    async def wait_idle(self) -> None:
        await self._idle.wait()

