"""A subscription to one server's KV event stream (asyncio, pyzmq): a SUB socket on its
endpoint, and its replay endpoint (vLLM's ROUTER) when it has one, feeding a `Held`.

Sequence numbers run from 0 without gaps. The feed is `complete` when what it applied covers
the stream since its start or its last `AllBlocksCleared` (then the server holds exactly what
the index says, as of the last event), `partial` otherwise (it joined late and the replay
buffer no longer reaches back, or a gap could not be replayed: then the index only ever
understates, since a missed removal is forgotten together with everything else):
- the first batch seen is 0, or a replay from 0 returns 0 first: complete;
- a gap (a batch missed): replayed from the first missed one; a replay that does not start
  there, or no replay endpoint, forgets the server's blocks (partial from then on);
- a sequence number going back (the server restarted): its blocks are forgotten;
- a batch that cannot be read (not a KV event batch): forgotten too, partial from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from prefixd.kvevents.index import Held
from prefixd.kvevents.wire import AllBlocksCleared, Batch, WireError, decode, seq_bytes, seq_of

log = logging.getLogger("prefixd.kvevents")
REPLAY_TIMEOUT_S = 2.0


@dataclass
class FeedState:
    state: str = "connecting"     # connecting | complete | partial
    last_seq: int | None = None
    last_ts: float = 0.0          # the publisher's time of the last batch
    delay_s: float = 0.0          # receipt minus publisher time, last batch


class Feed:
    """One server's stream into `held`; `on_event(kind)` counts what was applied."""

    def __init__(self, name: str, endpoint: str, held: Held, replay: str | None = None,
                 topic: str = "", on_batch: Callable[[Feed, Batch], None] | None = None
                 ) -> None:
        self.name, self.endpoint, self.replay_endpoint = name, endpoint, replay
        self.topic = topic.encode()
        self.held = held
        self.status = FeedState()
        self.counts: Counter[str] = Counter()   # batches, events, gaps, replays, restarts, bad
        self.on_batch = on_batch
        self.starts = 0                          # streams heard from their batch 0
        self._task: asyncio.Task[None] | None = None
        self._ctx = zmq.asyncio.Context.instance()

    @property
    def complete(self) -> bool:
        return self.status.state == "complete"

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kv-events:{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                try:
                    self._receive(frames, await self._catch_up(frames))
                except WireError as e:
                    self.counts["bad"] += 1
                    log.warning("kv events from %s: %s", self.name, e)
        finally:
            sub.close()

    async def _catch_up(self, frames: list[bytes]) -> list[tuple[int, bytes]]:
        """The batches to apply before this one, replayed (empty: none are missing)."""
        if len(frames) != 3:
            raise WireError(f"a message of {len(frames)} frames, not [topic, seq, payload]")
        seq, last = seq_of(frames[1]), self.status.last_seq
        if last is not None and seq <= last:          # the server started over
            self.counts["restarts"] += 1
            self._forget("partial")
            last = None
        want = 0 if last is None else last + 1
        if seq == want:
            if last is None:
                self.status.state = "complete"
            return []
        self.counts["gaps" if last is not None else "late_joins"] += 1
        got = await self._replay(want) if self.replay_endpoint else None
        got = [(s, p) for s, p in (got or []) if s < seq]
        if got and got[0][0] == want and [s for s, _ in got] == list(range(want, seq)):
            if last is None:
                self.status.state = "complete"
            return got
        if last is not None:                          # a removal may be lost: forget all
            self._forget("partial")
        self.status.state = "partial"
        # what the replay has past the gap, from `want` (not from `status.last_seq`: after a
        # restart that is the old stream's)
        return [(s, p) for s, p in got if s >= want]

    def _receive(self, frames: list[bytes], before: list[tuple[int, bytes]]) -> None:
        for seq, payload in [*before, (seq_of(frames[1]), frames[2])]:
            self.status.last_seq = seq                # read or not, it is behind us
            if seq == 0:
                self.starts += 1
            try:
                batch = decode(payload)
            except WireError as e:
                # it may have removed blocks: forget them all (a replay would only bring the
                # same bytes back, and every batch after it would wait for them)
                self.counts["bad"] += 1
                log.warning("kv events from %s: batch %d: %s", self.name, seq, e)
                self._forget("partial")
                continue
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    self.status.state = "complete"    # from here on the index is the server's
                self.held.apply(event)
                self.counts["events"] += 1
            self.counts["batches"] += 1
            self.status.last_ts = batch.ts
            self.status.delay_s = max(0.0, time.time() - batch.ts)
            if self.on_batch is not None:
                self.on_batch(self, batch)

    def _forget(self, state: str) -> None:
        self.held.clear()
        self.status.state = state

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The buffered batches from `start` (None: the replay endpoint did not answer)."""
        assert self.replay_endpoint is not None
        self.counts["replays"] += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart((b"", seq_bytes(start)))
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(left * 1000):
                    self.counts["replay_timeouts"] += 1
                    return None
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = seq_of(frames[1])
                if seq < 0:
                    return out
                out.append((seq, frames[2]))
        finally:
            sock.close()
