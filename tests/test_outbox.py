"""The generation thread's events reach the event loop in order, one wake-up per burst
(`scheduler/jobs.Outbox`)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from prefixd.backends.mlx.scheduler.jobs import Event, Outbox, Queued


async def test_a_burst_of_events_wakes_the_loop_once_and_keeps_each_queues_order() -> None:
    loop = asyncio.get_running_loop()
    wakes = 0
    original = loop.call_soon_threadsafe

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal wakes
        wakes += 1
        return original(*args, **kwargs)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    try:
        outbox = Outbox(loop)
        queues: list[asyncio.Queue[Event]] = [asyncio.Queue() for _ in range(3)]

        def burst() -> None:    # a decode pass of three requests, twenty tokens each
            for i in range(20):
                for q in queues:
                    outbox.put(q, Queued(i))

        thread = threading.Thread(target=burst)
        thread.start()
        thread.join(10)
        time.sleep(0)            # the loop has not run since: the burst is one wake-up
        assert wakes == 1
        for q in queues:
            got = [await asyncio.wait_for(q.get(), 5) for _ in range(20)]
            assert got == [Queued(i) for i in range(20)]
        outbox.put(queues[0], Queued(99))   # a new burst wakes it again
        assert await asyncio.wait_for(queues[0].get(), 5) == Queued(99)
        assert wakes == 2
    finally:
        loop.call_soon_threadsafe = original  # type: ignore[method-assign]


def test_an_outbox_whose_loop_is_gone_says_so_and_keeps_nothing() -> None:
    loop = asyncio.new_event_loop()
    outbox = Outbox(loop)
    queue: asyncio.Queue[Event] = asyncio.Queue()
    loop.close()
    with pytest.raises(RuntimeError):
        outbox.put(queue, Queued(1))
    with pytest.raises(RuntimeError):   # not stuck behind the first: it wakes (and fails) again
        outbox.put(queue, Queued(2))
    assert queue.empty()
