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
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from prefixd.kvevents.index import Held
from prefixd.kvevents.wire import AllBlocksCleared, Batch, WireError, decode, seq_bytes, seq_of

log = logging.getLogger("prefixd.kvevents")
REPLAY_TIMEOUT_S = 2.0
IDLE_S = 1.0          # a quiet stream's replay endpoint is asked this often for missed batches
RECENT = 4096         # batches remembered, to tell one that came by replay and live again


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=8).digest()


@dataclass
class FeedState:
    state: str = "connecting"     # connecting | complete | partial
    last_seq: int | None = None
    last_ts: float = 0.0          # the publisher's time of the last batch
    delay_s: float = 0.0          # receipt minus publisher time, last batch


class Feed:
    """One server's stream into `held`; `on_event(kind)` counts what was applied."""

    def __init__(self, name: str, endpoint: str, held: Held, replay: str | None = None,
                 topic: str = "", on_batch: Callable[[Feed, Batch], None] | None = None,
                 idle_s: float = IDLE_S) -> None:
        self.name, self.endpoint, self.replay_endpoint = name, endpoint, replay
        self.topic = topic.encode()
        self.held = held
        self.status = FeedState()
        self.counts: Counter[str] = Counter()   # batches, events, gaps, replays, restarts, bad
        self.on_batch = on_batch
        self.idle_s = idle_s
        self.starts = 0                          # streams heard from their batch 0
        self._recent: OrderedDict[int, bytes] = OrderedDict()   # seq -> its payload's digest
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
                if not await sub.poll(self.idle_s * 1000):
                    if self.replay_endpoint:          # quiet: ask whether a batch was missed
                        self._apply(await self._idle())
                    continue
                frames = await sub.recv_multipart()
                try:
                    if len(frames) != 3:
                        raise WireError(f"a message of {len(frames)} frames, not "
                                        "[topic, seq, payload]")
                    batch = (seq_of(frames[1]), frames[2])
                    self._apply(await self._catch_up(*batch))
                except WireError as e:
                    self.counts["bad"] += 1
                    log.warning("kv events from %s: %s", self.name, e)
        finally:
            sub.close()

    async def _idle(self) -> list[tuple[int, bytes]]:
        """Nothing came for `idle_s`: the batches published since the last one applied, as
        the replay endpoint has them (a subscriber misses what was sent before it connected,
        so a quiet stream's last batches arrive only this way). Asked from the last batch
        applied itself: a publisher's buffer always holds its own last batch, so an answer
        without ours, or with another batch under its number, is a server that started over
        (a restarted worker's opening batches, missed while reconnecting)."""
        last = self.status.last_seq
        got = await self._replay(0 if last is None else last, idle=True)
        if got is None or (last is None and not got):
            return []
        if last is not None and (not got or got[0][0] > last
                                 or self._recent.get(last) != _digest(got[0][1])):
            if not got or got[0][0] <= last:         # not the stream we followed: over
                self.counts["restarts"] += 1
                self._forget("partial")
                got = await self._replay(0, idle=True) or []
                return self._judge(0, got, None)
            return self._judge(last + 1, got, last)  # the buffer moved past ours: a gap
        want = 0 if last is None else last + 1
        fresh = [(s, p) for s, p in got if s >= want]
        if last is not None and not fresh:
            return []                                # ours is still its last: nothing missed
        return self._judge(want, fresh, last)

    async def _catch_up(self, seq: int, payload: bytes) -> list[tuple[int, bytes]]:
        """The batches to apply, this one last: replayed ones before it when some are
        missing; none when it was applied already (it came by replay first)."""
        last = self.status.last_seq
        if last is not None and seq <= last:
            if self._recent.get(seq) == _digest(payload):
                return []                             # had it already, by replay
            self.counts["restarts"] += 1              # the server started over
            self._forget("partial")
            last = None
        want = 0 if last is None else last + 1
        if seq == want:
            if last is None:
                self.status.state = "complete"
            return [(seq, payload)]
        self.counts["gaps" if last is not None else "late_joins"] += 1
        got = await self._replay(want) if self.replay_endpoint else None
        before = self._judge(want, [(s, p) for s, p in got or [] if want <= s < seq], last)
        return [*before, (seq, payload)]

    def _judge(self, want: int, got: list[tuple[int, bytes]], last: int | None
               ) -> list[tuple[int, bytes]]:
        """What to apply of replayed batches from `want`: all, when they start there without
        a hole (complete, if it started from nothing); else the blocks are forgotten (a
        removal may be lost) and the feed is partial."""
        if got and [s for s, _ in got] == list(range(want, want + len(got))):
            if last is None:
                self.status.state = "complete"
            return got
        if last is not None:
            self._forget("partial")
        self.status.state = "partial"
        return got

    def _apply(self, batches: list[tuple[int, bytes]]) -> None:
        for seq, payload in batches:
            self.status.last_seq = seq                # read or not, it is behind us
            self._recent[seq] = _digest(payload)
            while len(self._recent) > RECENT:
                self._recent.popitem(last=False)
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

    async def _replay(self, start: int, idle: bool = False) -> list[tuple[int, bytes]] | None:
        """The buffered batches from `start` (None: the replay endpoint did not answer)."""
        assert self.replay_endpoint is not None
        self.counts["idle_replays" if idle else "replays"] += 1
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
