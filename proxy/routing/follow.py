"""What endpoints announce of their caches, followed: one KV event subscription (vLLM's
format: `prefixd.kvevents`) per endpoint that has a stream, each feeding a token-level index
of what that endpoint holds, and the credit routing takes from it.

Owns: the feeds (started and stopped with the set of streams: `set`), their indexes, and the
credit rule. A prompt's token ids (the backend's own tokenizer) are looked up in every
followed endpoint's index (`credit`). A feed that is `complete` (it applied the stream since
its start, or its last `AllBlocksCleared`) is the endpoint's truth; a `partial` one (joined
after its replay buffer moved on, a gap it could not replay, its endpoint lost its cache
since) only adds to what answers taught, never takes from it. An endpoint whose cache was lost
(restarted, down: `lost`) has its blocks dropped and counts as partial until its stream
starts over.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prefixd.backends.config import BackendConfig
from prefixd.kvevents.index import Held, path_for
from prefixd.kvevents.publisher import connect_form
from prefixd.kvevents.subscriber import Feed
from prefixd.kvevents.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored
from prefixd.metrics import kvevents as m

EVENT_TYPES = {BlockStored: "stored", BlockRemoved: "removed", AllBlocksCleared: "cleared"}


@dataclass(frozen=True)
class Stream:
    """Where an endpoint publishes: its ZMQ endpoint, replay endpoint and topic prefix."""

    endpoint: str
    replay: str | None = None
    topic: str = ""


def streams_of(configs: Iterable[BackendConfig]) -> dict[str, Stream]:
    """The streams of the backends that have one (`kv_events`): a managed worker's as its
    worker binds it (a wildcard reached on loopback), a remote server's as given."""
    return {c.name: Stream(connect_form(c.kv_events),
                           connect_form(c.kv_events_replay) if c.kv_events_replay else None,
                           c.kv_events_topic)
            for c in configs if c.kv_events}


class Follow:
    def __init__(self) -> None:
        self.feeds: dict[str, Feed] = {}
        self._streams: dict[str, Stream] = {}
        self._starts: dict[str, int] = {}      # the feed's `starts` at its last loss

    async def set(self, streams: dict[str, Stream]) -> None:
        """Follow exactly these streams (started on the running loop; a changed one anew)."""
        for name in [n for n in self.feeds if self._streams.get(n) != streams.get(n)]:
            await self.feeds.pop(name).stop()
            self._streams.pop(name, None)
            m.COMPLETE.labels(name).set(0)
        for name, s in streams.items():
            if name not in self.feeds:
                feed = Feed(name, s.endpoint, Held(), s.replay, s.topic, self._applied)
                self.feeds[name], self._streams[name] = feed, s
                feed.start()

    async def close(self) -> None:
        await self.set({})

    def follows(self, names: Iterable[str]) -> bool:
        """Whether any of `names` has a feed that has heard its stream."""
        return any(n in self.feeds and self.feeds[n].status.last_seq is not None
                   for n in names)

    def credit(self, names: Iterable[str], tokens: Sequence[int]) -> dict[str, tuple[int, bool]]:
        """endpoint -> (tokens of the prompt it announced it holds, whether its feed is
        complete), for the followed ones among `names` that have heard their stream."""
        path = path_for(tokens)
        return {n: (self.feeds[n].held.held(tokens, path), self.feeds[n].complete)
                for n in names if n in self.feeds and self.feeds[n].status.last_seq is not None}

    def lost(self, name: str) -> None:
        """`name` lost its cache: what it announced before is gone (partial until its stream
        starts over or clears). Unless its stream already started over since the last loss:
        then what it says is its new cache's (a restarted worker announces its disk tier)."""
        feed = self.feeds.get(name)
        if feed is not None:
            if feed.starts > self._starts.get(name, 1):    # beyond the first stream heard
                self._starts[name] = feed.starts
                return
            feed.held.clear()
            if feed.status.state == "complete":
                feed.status.state = "partial"
            self._gauges(feed)

    def status(self, name: str) -> dict | None:
        """What /status shows of an endpoint's stream."""
        feed = self.feeds.get(name)
        if feed is None:
            return None
        s = feed.status
        return {"endpoint": feed.endpoint, "replay": feed.replay_endpoint, "state": s.state,
                "last_seq": s.last_seq, "delay_ms": round(s.delay_s * 1000, 1),
                "blocks": feed.held.media(), "counts": {**feed.counts, **feed.held.counts}}

    def _applied(self, feed: Feed, batch: Batch) -> None:
        m.BATCHES.labels(feed.name).inc()
        for e in batch.events:
            m.EVENTS.labels(feed.name, EVENT_TYPES[type(e)]).inc()
        m.DELAY.labels(feed.name).set(feed.status.delay_s)
        self._gauges(feed)

    def _gauges(self, feed: Feed) -> None:
        m.COMPLETE.labels(feed.name).set(int(feed.complete))
        media = feed.held.media()
        for medium in {"GPU", "DISK", *media}:
            m.BLOCKS.labels(feed.name, medium).set(media.get(medium, 0))
