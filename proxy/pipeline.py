"""The proxy: its backends, their queues, the router, the prefix state, and the stage list
every client request runs through (`proxy/stages`, built once here from Settings): the
request's stages, the last of which (route) runs the per-attempt stages once per backend it
tries.

`Proxy.handle` is the one aiohttp handler of every client API route. It builds the
`Exchange`, runs the stages, and turns any failure into the one error delivery the
response state allows (`Exchange.fail`); it also writes the request's trace.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from prefixd.api.errors import ApiError
from prefixd.backends.base import Backend, Managed
from prefixd.backends.config import BackendConfig
from prefixd.proxy.exchange import ClientApi, Exchange
from prefixd.proxy.keys import cache_namespace
from prefixd.proxy.pool import LoadStage, ModelPool
from prefixd.proxy.prefix.tracker import PrefixTracker
from prefixd.proxy.queue import BackendQueue
from prefixd.proxy.routing.router import Router
from prefixd.proxy.settings import Settings
from prefixd.proxy.stages import Stage, chain
from prefixd.proxy.stages.forward import ForwardStage
from prefixd.proxy.stages.parse import ParseStage
from prefixd.proxy.stages.prefix import CanonicalizeStage, DetectStage, MeasureStage
from prefixd.proxy.stages.queue import QueueStage
from prefixd.proxy.stages.relay import RelayStage
from prefixd.proxy.stages.route import RouteStage
from prefixd.proxy.stages.transfer import TransferStage
from prefixd.proxy.stages.translate import TranslateStage
from prefixd.proxy.stages.window import WindowStage
from prefixd.proxy.trace import RequestTrace

log = logging.getLogger("prefixd.proxy")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class Proxy:
    def __init__(self, settings: Settings, backends: list[Backend],
                 configs: dict[str, BackendConfig]) -> None:
        self.settings = settings
        self.backends = {b.name: b for b in backends}
        self.configs = configs
        self.queues = {b.name: BackendQueue(b.name, configs[b.name].concurrency,
                                            configs[b.name].queue_depth,
                                            configs[b.name].queue_timeout_s)
                       for b in backends}
        self.router = Router(self.backends, self.queues, settings)
        self.index = self.router.index           # model -> its backends, in configuration order
        self.prefix = PrefixTracker(settings)
        managed: list[Managed] = [m for b in backends if (m := b.managed()) is not None]
        self.pool = ModelPool.from_settings(managed, self.queues, settings) if managed else None
        self.stages = build_stages(self)
        self._run = chain(self.stages)
        self.inflight: set[Exchange] = set()

    @property
    def detecting(self) -> bool:
        return self.settings.prefix_detect

    def handler(self, api: ClientApi) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.handle(request, api)
        return handle

    async def handle(self, request: web.Request, api: ClientApi) -> web.StreamResponse:
        ex = Exchange(request, api, RequestTrace(_request_id(request)),
                      namespace=cache_namespace(request.headers, self.settings.cache_isolation))
        self.inflight.add(ex)
        try:
            await self._run(ex)
            assert ex.response is not None, "the relay stage always answers"
            return ex.response
        except ApiError as e:
            return await ex.fail(e)
        except (asyncio.CancelledError, ConnectionResetError) as e:
            if not ex.trace.completed and not ex.failed:   # the client left before the end
                ex.trace.status, ex.trace.error = 499, f"client went away ({type(e).__name__})"
            raise
        except Exception as e:
            log.exception("request %s failed inside prefixd", ex.trace.request_id)
            return await ex.fail(ApiError(500, f"internal error in prefixd ({type(e).__name__});"
                                          " see its log", code="internal_error"))
        finally:
            self.inflight.discard(ex)
            if ex.trace.usage is None and ex.attempt is not None:
                ex.trace.usage = ex.attempt.usage
            ex.trace.finish(self.settings.log_format)
            waited, backend = ex.trace.waited(), ex.trace.backend
            if waited is not None and backend in self.queues:
                self.queues[backend].waited(waited)


    async def cut_inflight(self) -> int:
        """Shutdown ran out of time: end every unfinished answer the way its state allows
        (a stream gets an error event and its end), then stop its handler."""
        cut = [ex for ex in self.inflight if not ex.trace.completed]
        for ex in cut:
            await ex.fail(ApiError(503, "prefixd is shutting down; the answer was cut",
                                   code="shutting_down"))
            if ex.request.task is not None:
                ex.request.task.cancel()
        return len(cut)


def build_stages(proxy: Proxy) -> list[Stage]:
    """The pipeline, in order; a feature that is off has no stage here. The request's stages
    run once; route runs the attempt's stages once per backend it tries (failover)."""
    s = proxy.settings
    stages: list[Stage] = [ParseStage(s.max_body_bytes, s.body_timeout_s), TranslateStage(),
                           CanonicalizeStage(proxy.prefix)]
    if s.prefix_detect:
        stages.append(DetectStage(proxy.prefix))
    per_attempt: list[Stage] = []
    if s.prefix_detect:
        per_attempt.append(MeasureStage(proxy.prefix))
    per_attempt += [WindowStage(), QueueStage(proxy.queues)]
    if proxy.pool is not None:
        per_attempt.append(LoadStage(proxy.pool))
    if s.route_transfer_min_tokens and sum(
            b.capabilities.moves_state for b in proxy.backends.values()) > 1:
        per_attempt.append(TransferStage(proxy.router, s.route_transfer_timeout_s))
    per_attempt += [ForwardStage(proxy.router,
                                 {n: c.request_timeout_s for n, c in proxy.configs.items()}),
                    RelayStage(proxy.prefix)]
    return [*stages, RouteStage(proxy.router, per_attempt)]


def _request_id(request: web.Request) -> str:
    """The client's X-Request-Id when it is a plain token (it goes into logs), else ours."""
    given = request.headers.get("X-Request-Id", "")
    return given if _REQUEST_ID.match(given) else uuid.uuid4().hex[:16]
