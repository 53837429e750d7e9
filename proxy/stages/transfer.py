"""transfer: before a prefixd worker serves a request, copy in the prefix state another worker
of the same model holds or is computing (planned by the router as the attempt's `transfer`), so the
prefix is computed once across workers instead of once per worker. Runs once the request has
its slot, before it is sent; the copy waits for the source's request computing the prefix to
end (a worker exports what its finished requests left), all bounded by
`PREFIXD_ROUTE_TRANSFER_TIMEOUT_S`. Any failure only costs the
copy: the request is then served as it would have been without it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from prefixd.backends.base import BackendError, BackendUnavailable
from prefixd.backends.worker_api import move_state
from prefixd.metrics import proxy as m
from prefixd.proxy.attempt import Attempt, TransferPlan
from prefixd.proxy.exchange import Exchange
from prefixd.proxy.routing.router import Router
from prefixd.proxy.stages import Next
from prefixd.proxy.stages.forward import forward_body, namespace_headers

log = logging.getLogger("prefixd.route")


class TransferStage:
    name = "transfer"

    def __init__(self, router: Router, timeout_s: float) -> None:
        self.router, self.timeout_s = router, timeout_s

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        assert ex.attempt is not None
        if ex.attempt.transfer is not None:
            await self._move(ex, ex.attempt, ex.attempt.transfer)
        await call_next(ex)

    async def _move(self, ex: Exchange, attempt: Attempt, plan: TransferPlan) -> None:
        target, source, expected = attempt.backend, plan.source, plan.tokens
        try:
            await target.ensure_ready()
        except (BackendUnavailable, BackendError):
            return                       # the forward stage reports it
        t0 = time.monotonic()
        if plan.computing is not None:   # the source's request computing it ends first
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.timeout_s):
                    await plan.computing.wait()
        left = max(0.1, self.timeout_s - (time.monotonic() - t0))
        # the request's cache partition on both ends (per-key isolation)
        moved = await move_state(self.router.backends[source].worker(), target.worker(),
                                 forward_body(ex), left, namespace_headers(ex, target))
        m.TRANSFERS.labels(source, target.name, moved.outcome).inc()
        m.TRANSFER_SECONDS.labels(target.name).observe(time.monotonic() - t0)
        m.TRANSFER_BYTES.labels(target.name).inc(moved.nbytes)
        ex.trace.transfer = f"{source}:{moved.outcome}:{moved.tokens}"
        # 409: another model's state; 403: the pair holds different transfer secrets
        self.router.transferred(source, target.name, moved.tokens,
                                incompatible=moved.status in (403, 409))
        if moved.outcome != "moved":
            log.info("request %s: no prefix state from %s for %s (%s%s; %d tokens expected)",
                     ex.trace.request_id, source, target.name, moved.outcome,
                     f": {moved.detail}" if moved.detail else "", expected)
            return
        m.TRANSFER_TOKENS.labels(target.name).inc(moved.tokens)
        attempt.transferred = moved.tokens
        report = ex.prepared.report if ex.prepared is not None else None
        if report is not None and moved.tokens > (report.predicted_cached_tokens or 0):
            report.predicted_cached_tokens = moved.tokens
