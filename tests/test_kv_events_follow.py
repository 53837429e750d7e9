"""The router's feeds (`proxy/routing/follow.py`) when a backend loses its cache: what it
announced before is forgotten, unless its stream already started over since (a restarted
worker announces its disk tier first thing, and that must stay). Real publishers on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from worker_process import free_port

from prefixd.kvevents import wire
from prefixd.kvevents.publisher import Publisher
from prefixd.proxy.routing.follow import Follow, Stream

DEADLINE = 20.0
TOKENS = list(range(100, 116))


async def until(cond: Callable[[], bool]) -> None:
    end = time.monotonic() + DEADLINE
    while not cond():
        assert time.monotonic() < end, "not reached before the deadline"
        await asyncio.sleep(0.02)


def opening(block: int) -> list[wire.Event]:
    return [wire.AllBlocksCleared(),
            wire.BlockStored((block,), None, tuple(TOKENS), len(TOKENS), medium="DISK")]


async def test_a_loss_forgets_unless_the_stream_started_over_since() -> None:
    port, replay = free_port(), free_port()
    endpoint, replay_at = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"
    follow = Follow()
    await follow.set({"w": Stream(endpoint, replay_at)})
    feed = follow.feeds["w"]
    prompt = [*TOKENS, 7]
    pub = Publisher(endpoint, replay_at)
    try:
        pub.publish(opening(1))
        await until(lambda: feed.status.last_seq == 0 and feed.complete)
        assert follow.credit(["w"], prompt) == {"w": (16, True)}
        follow.lost("w")                      # the first stream's backend lost its cache
        assert follow.credit(["w"], prompt) == {"w": (0, False)}
        assert feed.status.state == "partial"
        pub.close()
        pub = Publisher(endpoint, replay_at)  # restarted: opens with its disk tier
        pub.publish(opening(2))
        await until(lambda: feed.starts == 2 and feed.complete)
        follow.lost("w")                      # the router hears of the restart only now
        assert follow.credit(["w"], prompt) == {"w": (16, True)}
    finally:
        pub.close()
        await follow.close()
