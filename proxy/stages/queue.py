"""queue: take one of the attempt's backend's slots (`BackendQueue`: FIFO, depth cap → 429,
wait cap → 503), held by the attempt until the route stage ends it — or hands it to the next
attempt on the same backend (its restarted worker), so a request sent again keeps its place.
A streaming client that has to wait gets its SSE response at once, with `: queued
position=N` comments while it waits."""

from __future__ import annotations

from prefixd.api.errors import ApiError
from prefixd.proxy.exchange import SSE_HEADERS, Exchange, ResponseState
from prefixd.proxy.queue import BackendQueue, QueueClosed, QueueFull, QueueTimeout
from prefixd.proxy.stages import Next


class QueueStage:
    name = "queue"

    def __init__(self, queues: dict[str, BackendQueue]) -> None:
        self.queues = queues

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        assert ex.attempt is not None
        attempt = ex.attempt
        if attempt.slot is not None:             # kept from the attempt before: its place
            await call_next(ex)
            return
        queue = self.queues[attempt.backend.name]
        on_position = None
        if ex.stream and queue.would_wait() and not queue.full():
            # started already when an earlier attempt's queue held it (then failed over)
            resp = ex.response if ex.state is ResponseState.SSE else \
                await ex.start(200, SSE_HEADERS, sse=True)
            assert resp is not None

            async def on_position(pos: int) -> None:
                await resp.write(f": queued position={pos}\n\n".encode())
        try:
            # sent again: it waited its turn already, so it goes first
            attempt.slot = await queue.acquire(on_position, front=attempt.again)
            attempt.queue_wait = attempt.slot.waited
        except QueueFull:
            raise ApiError(429, f"backend {queue.name!r} queue is full ({queue.depth} "
                           "waiting); retry later", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except QueueTimeout:
            raise ApiError(503, f"waited {queue.timeout_s:g}s in the queue of backend "
                           f"{queue.name!r} without getting a slot",
                           code="queue_timeout") from None
        except QueueClosed:
            raise ApiError(503, "prefixd is shutting down", code="shutting_down") from None
        await call_next(ex)
