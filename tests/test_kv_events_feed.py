"""The KV event stream over real sockets: prefixd's `Publisher` read by raw ZMQ sockets as
vLLM's consumers read vLLM's (sequence numbers, topic, the replay endpoint), and `Feed`
following a stream into a `Held`: late joins, gaps, restarts, unreadable batches, each with
or without a replay, against a real publisher or one driven here by hand."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import msgpack
import pytest
import zmq
import zmq.asyncio
from worker_process import free_port

from prefixd.kvevents import subscriber, wire
from prefixd.kvevents.index import Held
from prefixd.kvevents.publisher import Publisher
from prefixd.kvevents.subscriber import Feed

DEADLINE = 10.0        # every wait is bounded by this (never a threshold asserted on)
BLOCK = 4



def tcp(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def tokens_of(i: int) -> list[int]:
    """Batch `i`'s block: BLOCK tokens no other batch's block starts with."""
    return [1000 + i] * BLOCK


def stored(i: int, parent: int | None = None) -> wire.BlockStored:
    """A block of BLOCK tokens, id `i`; at a prompt's start, or below block `parent`."""
    return wire.BlockStored((i,), parent, tuple(tokens_of(i)), BLOCK, medium="GPU")


def credited(held: Held, *chain: int) -> int:
    """What `held` credits a prompt made of blocks `chain` (then one token more)."""
    return held.held([t for i in chain for t in tokens_of(i)] + [7])


def payload(events: Sequence[wire.Event], encoding: str = wire.MAP) -> bytes:
    return wire.encode(wire.Batch(time.time(), tuple(events)), encoding)


# ---- the publisher, read by raw sockets ----

@contextlib.contextmanager
def publisher(**kw: object) -> Iterator[tuple[Publisher, str, str]]:
    endpoint, replay = tcp(free_port()), tcp(free_port())
    pub = Publisher(endpoint, replay, **kw)  # type: ignore[arg-type]
    try:
        yield pub, endpoint, replay
    finally:
        pub.close()


@contextlib.contextmanager
def sockets() -> Iterator[Callable[[int], zmq.Socket]]:
    ctx = zmq.Context()
    made: list[zmq.Socket] = []

    def make(kind: int) -> zmq.Socket:
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        made.append(s)
        return s
    try:
        yield make
    finally:
        for s in made:
            s.close()
        ctx.term()


def recv(sock: zmq.Socket) -> list[bytes]:
    if not sock.poll(DEADLINE * 1000):
        raise AssertionError("nothing received before the deadline")
    return sock.recv_multipart()


def wait_sent(pub: Publisher, n: int) -> None:
    deadline = time.monotonic() + DEADLINE
    while pub.sent < n:
        assert time.monotonic() < deadline, f"the publisher sent {pub.sent} of {n}"
        time.sleep(0.005)


def replay_all(sock: zmq.Socket, start: int) -> list[tuple[int, bytes]]:
    """A DEALER's replay: [b"", start] out; [b"", seq, payload] back, until seq -1."""
    sock.send_multipart([b"", wire.seq_bytes(start)])
    out = []
    while True:
        frames = recv(sock)
        assert len(frames) == 3 and frames[0] == b"", frames
        seq = wire.seq_of(frames[1])
        if seq == -1:
            assert frames[2] == b""
            return out
        out.append((seq, frames[2]))


def test_sequence_numbers_topic_and_replay() -> None:
    topic = "kv@pod-1@model"
    with publisher(topic=topic) as (pub, endpoint, replay), sockets() as make:
        sub = make(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@pod-1")
        sub.connect(endpoint)
        published: list[tuple[wire.Event, ...]] = []

        def publish_next() -> None:
            events = (stored(len(published)),)
            published.append(events)
            pub.publish(events)

        # a PUB drops what it sends before the subscription reaches it: publish until the
        # subscriber hears one, then on to N
        heard: list[list[bytes]] = []
        deadline = time.monotonic() + DEADLINE
        while not heard:
            assert time.monotonic() < deadline, "the subscriber never heard the publisher"
            publish_next()
            if sub.poll(50):
                heard.append(sub.recv_multipart())
        n = len(published) + 20
        pub.publish([])                               # nothing to say: no batch, no number
        while len(published) < n:
            publish_next()
        while wire.seq_of(heard[-1][1]) < n - 1:
            heard.append(recv(sub))

        seqs = [wire.seq_of(f[1]) for f in heard]
        assert seqs == list(range(seqs[0], n))        # in order, none missing
        assert all(len(f) == 3 and f[0] == topic.encode() for f in heard)
        for f, seq in zip(heard, seqs, strict=True):
            assert wire.decode(f[2]).events == published[seq]
        wait_sent(pub, n)
        assert pub.sent == n

        dealer = make(zmq.DEALER)
        dealer.connect(replay)
        got = replay_all(dealer, 0)                   # all of it, from 0
        assert [s for s, _ in got] == list(range(n))
        assert [wire.decode(p).events for _, p in got] == published
        assert dict(got)[seqs[0]] == heard[0][2]      # the same bytes as were published
        assert [s for s, _ in replay_all(dealer, n - 3)] == [n - 3, n - 2, n - 1]
        assert replay_all(dealer, n) == []            # nothing from there: just the end
        assert replay_all(dealer, n + 100) == []

        # a request that is not one is ignored; the next is answered
        dealer.send_multipart([b"", b"\x00\x01"])
        assert [s for s, _ in replay_all(dealer, n - 1)] == [n - 1]
        assert pub.replays == 5

        # a REQ client (vLLM's example consumer's) gets the first frame of its answer
        req = make(zmq.REQ)
        req.connect(replay)
        req.send(wire.seq_bytes(2))
        first = recv(req)
        assert wire.seq_of(first[0]) == 2 and wire.decode(first[1]).events == published[2]


@pytest.mark.parametrize("encoding", wire.ENCODINGS)
def test_the_replay_buffer_keeps_the_last_buffer_steps(encoding: str) -> None:
    with publisher(buffer_steps=3, encoding=encoding) as (pub, _, replay), sockets() as make:
        for i in range(7):
            pub.publish([stored(i)])
        wait_sent(pub, 7)
        dealer = make(zmq.DEALER)
        dealer.connect(replay)
        got = replay_all(dealer, 0)
        assert [s for s, _ in got] == [4, 5, 6]       # 0 to 3 are gone
        assert [wire.decode(p).events for _, p in got] == [(stored(i),) for i in (4, 5, 6)]
        raw = msgpack.unpackb(got[0][1])
        assert isinstance(raw, dict if encoding == wire.MAP else list)


def test_a_publisher_that_cannot_bind_says_so_and_keeps_nothing_open() -> None:
    with sockets() as make:
        busy = tcp(make(zmq.ROUTER).bind_to_random_port("tcp://127.0.0.1"))
        endpoint = tcp(free_port())
        with pytest.raises(OSError, match="cannot open") as failed:
            Publisher(endpoint, replay_endpoint=busy)
        with pytest.raises(OSError, match="cannot open"):
            Publisher(busy)
        # the stream's port, bound before the replay's failed, was let go
        assert failed.value is not None
        Publisher(endpoint).close()


# ---- Feed ----

class Follow:
    """A running Feed and the sequence numbers of the batches it applied, in order."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed
        self.seqs: list[int] = []
        self._news = asyncio.Event()
        feed.on_batch = self._applied

    @property
    def held(self) -> Held:
        return self.feed.held

    def _applied(self, feed: Feed, _batch: wire.Batch) -> None:
        assert feed.status.last_seq is not None
        self.seqs.append(feed.status.last_seq)
        self._news.set()

    async def wait(self, cond: Callable[[], bool], timeout: float = DEADLINE) -> bool:
        """Until `cond()` holds, re-checked after every batch applied (False: timed out)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not cond():
            left = end - loop.time()
            if left <= 0:
                return False
            self._news.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._news.wait(), left)
        return True

    async def until(self, seq: int) -> None:
        assert await self.wait(lambda: seq in self.seqs), \
            f"batch {seq} not applied: {self.seqs}, counts {dict(self.feed.counts)}"


@contextlib.asynccontextmanager
async def following(endpoint: str, replay: str | None, topic: str = "",
                    idle_s: float = subscriber.IDLE_S) -> AsyncIterator[Follow]:
    feed = Feed("server", endpoint, Held(), replay=replay, topic=topic, idle_s=idle_s)
    follow = Follow(feed)
    feed.start()
    try:
        yield follow
    finally:
        await feed.stop()


async def heard(f: Follow, publish: Callable[[], int]) -> int:
    """Publish (a batch each time, `publish` returns its sequence number) until the feed has
    applied something: a SUB hears nothing sent before its subscription arrived."""
    end = time.monotonic() + DEADLINE
    while True:
        assert time.monotonic() < end, "the feed never heard the publisher"
        last = publish()
        if await f.wait(lambda: bool(f.seqs), 0.05):
            return last


async def test_a_feed_that_joins_late_is_replayed_to_complete() -> None:
    with publisher(topic="kv@a") as (pub, endpoint, replay):
        for i in range(5):
            pub.publish([stored(i)])
        pub.publish([stored(5, parent=4)])            # a chain across batches
        wait_sent(pub, 6)
        async with following(endpoint, replay, topic="kv@a") as f:
            assert f.feed.status.state == "connecting"
            count = [6]

            def publish() -> int:
                pub.publish([stored(count[0])])
                count[0] += 1
                return count[0] - 1
            last = await heard(f, publish)
            await f.until(last)
            assert f.seqs == list(range(last + 1))    # the replay first, then the stream
            assert f.feed.complete and f.feed.starts == 1
            assert f.feed.counts["late_joins"] == 1 and f.feed.counts["replays"] == 1
            assert len(f.held) == last + 1
            assert all(credited(f.held, i) == BLOCK for i in (0, 1, 2, 3, 4, last))
            assert credited(f.held, 4, 5) == 2 * BLOCK
            pub.publish([wire.BlockRemoved((4,), "GPU")])   # 5 hangs below 4: goes too
            await f.until(last + 1)
            assert f.feed.complete
            assert credited(f.held, 4, 5) == credited(f.held, 4) == 0
            assert len(f.held) == last + 1 - 2


async def test_a_feed_the_replay_no_longer_reaches_is_partial() -> None:
    with publisher(buffer_steps=3) as (pub, endpoint, replay):
        for i in range(6):
            pub.publish([stored(i)])
        wait_sent(pub, 6)
        async with following(endpoint, replay) as f:
            count = [6]

            def publish() -> int:
                pub.publish([stored(count[0])])
                count[0] += 1
                return count[0] - 1
            last = await heard(f, publish)
            await f.until(last)
            assert f.feed.status.state == "partial"
            assert f.feed.counts["late_joins"] == 1
            assert credited(f.held, 0) == 0            # before the buffer: never seen
            assert credited(f.held, last) == BLOCK
            first = f.seqs[0]
            assert first > 0 and f.seqs == list(range(first, last + 1))
            assert all(credited(f.held, i) == BLOCK for i in f.seqs)
            assert len(f.held) == len(f.seqs)

            # the server clears its cache: from there on the index is all of it
            pub.publish([wire.AllBlocksCleared(), stored(100)])
            await f.until(last + 1)
            assert f.feed.complete
            assert len(f.held) == 1 and credited(f.held, 100) == BLOCK


class Hand:
    """A publisher driven by hand: an XPUB (so the test knows when the feed has subscribed)
    sending chosen sequence numbers, and a ROUTER replay endpoint answered by hand."""

    def __init__(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        self.pub = ctx.socket(zmq.XPUB)
        self.router = ctx.socket(zmq.ROUTER)
        for s in (self.pub, self.router):
            s.setsockopt(zmq.LINGER, 0)
        self.endpoint = tcp(self.pub.bind_to_random_port("tcp://127.0.0.1"))
        self.replay = tcp(self.router.bind_to_random_port("tcp://127.0.0.1"))
        self.sent: dict[int, bytes] = {}

    def close(self) -> None:
        self.pub.close()
        self.router.close()

    async def subscribed(self) -> None:
        msg = await asyncio.wait_for(self.pub.recv(), DEADLINE)
        assert msg[:1] == b"\x01", msg                # a subscription (b"\x00": leaving)

    async def send(self, seq: int, events: Sequence[wire.Event] | bytes,
                   topic: bytes = b"") -> None:
        data = events if isinstance(events, bytes) else payload(events)
        self.sent[seq] = data
        await self.pub.send_multipart([topic, wire.seq_bytes(seq), data])

    async def request(self) -> tuple[bytes, int]:
        """The next replay request: (who, start)."""
        frames = await asyncio.wait_for(self.router.recv_multipart(), DEADLINE)
        assert len(frames) == 3 and frames[1] == b"", frames
        return frames[0], wire.seq_of(frames[2])

    async def answer(self, who: bytes, seqs: Sequence[int]) -> None:
        for seq in seqs:
            await self.router.send_multipart([who, b"", wire.seq_bytes(seq), self.sent[seq]])
        await self.router.send_multipart([who, b"", wire.END_SEQ, b""])


@contextlib.asynccontextmanager
async def by_hand(replay: bool = True, idle_s: float = 600.0
                  ) -> AsyncIterator[tuple[Hand, Follow]]:
    """`idle_s`: the feed's quiet-stream probe, late enough by default that every replay
    request the test answers is the one it expects."""
    hand = Hand()
    try:
        async with following(hand.endpoint, hand.replay if replay else None,
                             idle_s=idle_s) as f:
            await hand.subscribed()
            yield hand, f
    finally:
        hand.close()


async def test_a_feed_from_batch_0_is_complete_without_a_replay() -> None:
    async with by_hand() as (hand, f):
        await hand.send(0, [stored(1)])
        await hand.send(1, [stored(2, parent=1)])
        await f.until(1)
        assert f.seqs == [0, 1] and f.feed.complete
        assert f.feed.counts["replays"] == 0 and f.feed.status.last_seq == 1
        assert credited(f.held, 1, 2) == 2 * BLOCK


async def test_a_gap_is_replayed_in_order() -> None:
    async with by_hand() as (hand, f):
        await hand.send(0, [stored(1)])
        await hand.send(1, [stored(2)])
        await f.until(1)
        hand.sent[2] = payload([stored(3)])           # missed: 4 hangs below it
        hand.sent[3] = payload([wire.BlockRemoved((1,), "GPU")])
        await hand.send(4, [stored(4, parent=3)])
        who, start = await hand.request()
        assert start == 2
        await hand.answer(who, [2, 3, 4])             # the batch that prompted it too
        await f.until(4)
        assert f.seqs == [0, 1, 2, 3, 4] and f.feed.complete
        assert f.feed.counts["gaps"] == 1
        assert credited(f.held, 3, 4) == 2 * BLOCK and credited(f.held, 2) == BLOCK
        assert credited(f.held, 1) == 0 and len(f.held) == 3
        await hand.send(5, [stored(5)])
        await f.until(5)
        assert f.feed.complete and f.feed.counts["replays"] == 1


async def test_a_gap_without_replay_forgets() -> None:
    async with by_hand(replay=False) as (hand, f):
        await hand.send(0, [stored(1)])
        await hand.send(1, [stored(2)])
        await f.until(1)
        # 2 (missed) stored block 3 and removed block 1: the feed cannot know which
        await hand.send(3, [stored(4, parent=3)])
        await f.until(3)
        assert f.feed.status.state == "partial" and f.feed.counts["gaps"] == 1
        assert len(f.held) == 0 and f.held.counts["unplaced"] == 1
        assert credited(f.held, 1) == credited(f.held, 2) == 0
        await hand.send(4, [stored(5)])               # placed, still partial
        await f.until(4)
        assert f.feed.status.state == "partial" and credited(f.held, 5) == BLOCK
        await hand.send(5, [wire.AllBlocksCleared(), stored(6)])
        await f.until(5)
        assert f.feed.complete and len(f.held) == 1 and credited(f.held, 6) == BLOCK


@pytest.mark.parametrize("answer", ["too late", "nothing", "silence"])
async def test_a_gap_the_replay_cannot_fill_forgets(answer: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subscriber, "REPLAY_TIMEOUT_S", 0.3)
    async with by_hand() as (hand, f):
        await hand.send(0, [stored(1)])
        await f.until(0)
        hand.sent[1] = payload([wire.BlockRemoved((1,), "GPU")])
        hand.sent[2] = payload([stored(2)])
        await hand.send(3, [stored(3)])
        who, start = await hand.request()
        assert start == 1
        if answer == "too late":                      # the buffer no longer has 1
            await hand.answer(who, [2, 3])
        elif answer == "nothing":
            await hand.answer(who, [])
        await f.until(3)
        assert f.feed.status.state == "partial"
        assert credited(f.held, 1) == 0               # forgotten: it may have been removed
        assert credited(f.held, 3) == BLOCK
        assert credited(f.held, 2) == (BLOCK if answer == "too late" else 0)
        assert f.feed.counts["replay_timeouts"] == (answer == "silence")


async def test_a_sequence_going_back_forgets() -> None:
    async with by_hand() as (hand, f):
        for seq in range(3):
            await hand.send(seq, [stored(seq + 1)])
        await f.until(2)
        assert f.feed.complete and len(f.held) == 3
        await hand.send(0, [stored(10)])              # the server started over
        assert await f.wait(lambda: len(f.seqs) == 4)
        assert f.feed.complete and f.feed.counts["restarts"] == 1 and f.feed.starts == 2
        assert len(f.held) == 1 and credited(f.held, 10) == BLOCK
        assert credited(f.held, 1) == 0


async def test_a_restart_heard_late_keeps_what_the_replay_has() -> None:
    """A restarted server heard first at its batch 3, its buffer holding 1 and 2 (0 is gone):
    partial, and 1 to 3 applied (a replay past the old stream's last sequence number)."""
    async with by_hand() as (hand, f):
        for seq in range(6):
            await hand.send(seq, [stored(seq + 1)])
        await f.until(5)
        hand.sent = {}
        hand.sent[1] = payload([stored(21)])
        hand.sent[2] = payload([stored(22, parent=21)])
        await hand.send(3, [stored(23)])
        who, start = await hand.request()
        assert start == 0
        await hand.answer(who, [1, 2, 3])
        assert await f.wait(lambda: len(f.seqs) == 6 + 3), f.seqs
        assert f.seqs[6:] == [1, 2, 3]
        assert f.feed.status.state == "partial" and f.feed.counts["restarts"] == 1
        assert credited(f.held, 21, 22) == 2 * BLOCK and credited(f.held, 23) == BLOCK
        assert credited(f.held, 1) == 0 and len(f.held) == 3


async def test_an_unreadable_batch_forgets_and_the_stream_goes_on() -> None:
    """A batch that is not one cannot be applied, and replaying it brings the same bytes:
    the feed forgets (it may have removed blocks) and follows on from it."""
    async with by_hand() as (hand, f):
        await hand.send(0, [stored(1)])
        await f.until(0)
        await hand.send(1, b"\xc1 not msgpack")
        await hand.send(2, [stored(2)])
        await hand.send(3, [stored(3, parent=2)])

        async def serve() -> None:                    # a replay endpoint like a real one
            while True:
                who, _, start = await hand.router.recv_multipart()
                first = wire.seq_of(start)
                await hand.answer(who, [s for s in sorted(hand.sent) if s >= first])
        server = asyncio.create_task(serve())
        try:
            await f.until(3)
        finally:
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server
        assert f.seqs == [0, 2, 3]
        assert f.feed.counts["bad"] == 1 and f.feed.status.last_seq == 3
        assert f.feed.status.state == "partial"
        assert credited(f.held, 1) == 0 and credited(f.held, 2, 3) == 2 * BLOCK
        await hand.send(4, [wire.AllBlocksCleared()])
        await f.until(4)
        assert f.feed.complete and len(f.held) == 0


async def test_a_feed_follows_its_topic_only() -> None:
    hand = Hand()
    try:
        async with following(hand.endpoint, hand.replay, topic="kv@b@m") as f:
            assert await asyncio.wait_for(hand.pub.recv(), DEADLINE) == b"\x01kv@b@m"
            await hand.send(0, [stored(1)], topic=b"kv@c@m")
            await hand.send(0, [stored(2)], topic=b"kv@b@m")
            await hand.send(1, [stored(3)], topic=b"kv@b@m-2")   # a prefix match, as ZMQ's
            await f.until(1)
            assert f.seqs == [0, 1] and f.feed.complete
            assert credited(f.held, 1) == 0 and credited(f.held, 2) == BLOCK
            assert credited(f.held, 3) == BLOCK
    finally:
        hand.close()


async def test_a_quiet_streams_batches_arrive_without_another_one() -> None:
    """What was published before the feed connected (a worker's opening batches), with nothing
    after it: the feed asks the replay endpoint once the stream is quiet, and is complete."""
    with publisher() as (pub, endpoint, replay):
        pub.publish([wire.AllBlocksCleared()])
        pub.publish([stored(0)])
        pub.publish([stored(1, parent=0)])
        wait_sent(pub, 3)
        async with following(endpoint, replay) as f:
            await f.until(2)
            assert f.seqs == [0, 1, 2] and f.feed.complete
            assert f.feed.counts["idle_replays"] >= 1 and f.feed.counts["late_joins"] == 0
            assert credited(f.held, 0, 1) == 2 * BLOCK


async def test_a_quiet_stream_stays_as_it_was() -> None:
    """The probe of a stream that published nothing since (its replay from the last batch
    applied returns that batch alone) changes nothing: the feed stays complete, its blocks
    credited."""
    async with by_hand(idle_s=0.2) as (hand, f):
        for seq in range(3):
            await hand.send(seq, [stored(seq + 1)])
        await f.until(2)
        for _ in range(2):                            # two probes: the first was applied
            who, start = await hand.request()
            assert start == 2
            await hand.answer(who, [2])
        assert f.seqs == [0, 1, 2] and f.feed.complete
        assert f.feed.counts["restarts"] == 0 and f.feed.counts["idle_replays"] >= 2
        assert credited(f.held, 3) == BLOCK


async def test_a_restart_missed_live_is_found_by_the_quiet_streams_probe() -> None:
    """The server restarts and its opening batches are missed while the feed reconnects: the
    probe (a replay from the last batch applied) finds the buffer without it, so the feed
    forgets the old blocks and takes the new stream from 0."""
    async with by_hand(idle_s=0.5) as (hand, f):
        for seq in range(3):
            await hand.send(seq, [stored(seq + 1)])
        await f.until(2)
        hand.sent = {0: payload([wire.AllBlocksCleared()]), 1: payload([stored(30)])}
        who, start = await hand.request()             # the probe, once the stream is quiet
        assert start == 2
        await hand.answer(who, [])                    # its last batch is 1: a new stream
        who, start = await hand.request()
        assert start == 0
        await hand.answer(who, [0, 1])
        assert await f.wait(lambda: len(f.seqs) == 5), f.seqs
        assert f.seqs[3:] == [0, 1] and f.feed.complete
        assert f.feed.counts["restarts"] == 1 and f.feed.starts == 2
        assert credited(f.held, 30) == BLOCK and credited(f.held, 1) == 0


def test_a_publisher_opened_again_waits_for_its_port_a_moment() -> None:
    """A publisher opened while its port is still held for a moment (ZMQ lets go of a closed
    socket on its own thread, after `close` returns: a publisher restarted in the same
    process) binds once the port is free instead of failing; one held longer fails with the
    cause named."""
    port, replay = free_port(), free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", replay))
    holder.listen()
    threading.Timer(0.3, holder.close).start()          # let go well within REBIND_S
    Publisher(tcp(port), tcp(replay)).close()
    with socket.socket() as stuck:
        stuck.bind(("127.0.0.1", 0))
        stuck.listen()
        with pytest.raises(OSError, match="Address already in use"):
            Publisher(tcp(stuck.getsockname()[1]))
