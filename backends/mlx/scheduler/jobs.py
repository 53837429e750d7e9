"""A generation job: what crosses between the worker's event loop and its generation thread.

Owns: `Job` (a prompt and its sampling in; its events out, through an asyncio.Queue the thread feeds
thread-safely; its `cancel` flag, which the Engine polls as `should_stop`, so a client that goes
away stops generation within one decode step), the events (`Queued` while it waits to be admitted
behind others, `Delta` from `scheduler/output.py`, then one `Finished` or `Failed`), the `Outbox`
they cross in (one wake-up of the event loop per burst, not one per event), and
`WorkerClosed`. Nothing here runs mlx or speaks HTTP: `generator.py` runs jobs, `server/respond.py`
turns their events into responses.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.scheduler.output import Delta


class WorkerClosed(RuntimeError):
    """The generation thread is shut down: no new job can run."""


class Outbox:
    """Events on their way from the generation thread to the event loop's queues: the first
    event of a burst wakes the loop (`call_soon_threadsafe`, a write to its self-pipe), the
    ones put before it runs go with it. A decode pass of eight requests then wakes the loop
    once, not eight times. Each queue gets its events in the order they were put."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[Event], Event]] = []

    def put(self, queue: asyncio.Queue[Event], event: Event) -> None:
        """Raises RuntimeError when the event loop is gone (nobody listens)."""
        with self._lock:
            first = not self._items
            self._items.append((queue, event))
        if first:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:
                with self._lock:
                    self._items.clear()
                raise

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, event in items:
            queue.put_nowait(event)


@dataclass(frozen=True)
class Finished:
    """The last event of a job. `finish_reason`: stop, length, or cancelled (client gone).
    `prefixd`: where the time went (`stats.breakdown`), for the response."""

    finish_reason: str
    completion_tokens: int
    cached_tokens: int
    prefixd: dict[str, Any] | None = None
    stop: str | None = None    # the stop string that ended it (vLLM's `stop_reason`)


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(frozen=True)
class Queued:
    """The job waits to be admitted (max_active > 1: the worker is full, or the live caches
    of the jobs under way leave no room for it): its place among the waiting, from 1."""

    position: int


Event = Queued | Delta | Finished | Failed  # Delta: a text delta


@dataclass(eq=False)  # identity-hashed: pending jobs live in a set
class Job:
    prompt: Prompt
    sampling: Sampling
    max_tokens: int
    logprobs: int | None  # None: none; else how many alternatives per token
    emit: Callable[[Event], None]
    _queue: asyncio.Queue[Event]
    _cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    queue_s: float = 0.0   # how long it waited for the generation thread (to be admitted)
    paused_s: float = 0.0  # admitted, how long other jobs' passes ran (max_active > 1)
    namespace: str = ""   # its cache partition (per-key isolation; "" shared)
    id: int = 0           # the worker's number for it (a group's journal names jobs by it)
    position: int = 0     # its last `Queued` position sent (0: none)

    def cancel(self) -> None:
        """Stop generating (idempotent; harmless once the job has finished)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, Finished | Failed):
                return
