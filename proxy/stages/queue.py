"""queue: hold one of the chosen backend's slots while the rest of the pipeline runs
(`BackendQueue`: FIFO, depth cap → 429, wait cap → 503). A streaming client that has to wait
gets its SSE response at once, with `: queued position=N` comments while it waits."""

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
            async with queue.slot(on_position) as waited:
                attempt.queue_wait = waited
                await call_next(ex)
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
