"""route: the requested model → its backends → one of them, and failover, as one explicit loop
over attempts (`proxy/attempt.py`). The decisions are the router's (`proxy/routing`); this
stage runs them: one routing view per request, then an attempt per backend tried, each through
the per-attempt stages (measure → queue → load → transfer → forward → relay) with nothing
carried over from an earlier try but the request's response state.

An attempt whose backend took nothing of the request (`BackendGone`: its connection was
refused, or it died before any of the answer was sent) makes the router forget that backend's
cache and the request go to another backend of the model; when none is left but a managed
worker that restarts itself, once more to its successor. After a complete answer, what the
backend reported corrects the router's prefix index."""

from __future__ import annotations

import asyncio

from prefixd.api.errors import ApiError
from prefixd.backends.base import BackendGone
from prefixd.proxy.attempt import Attempt
from prefixd.proxy.exchange import Exchange
from prefixd.proxy.routing.index import boundaries
from prefixd.proxy.routing.router import Router, RouteView
from prefixd.proxy.stages import Next, Stage, chain
from prefixd.proxy.stages.window import TOKENIZE_TIMEOUT_S


class RouteStage:
    name = "route"

    def __init__(self, router: Router, attempt_stages: list[Stage]) -> None:
        self.router = router
        self.attempt_stages = attempt_stages
        self._run_attempt = chain(attempt_stages)

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        assert ex.parsed is not None
        ex.model = ex.trace.model = self.router.model_for(ex.parsed.req.model)
        prepared = ex.prepared
        ex.prompt_ids = await self._tokens(ex)
        view = self.router.view(ex.model, prepared.lane if prepared is not None else None,
                                boundaries(prepared.segments if prepared is not None else [],
                                           namespace=ex.namespace), ex.prompt_ids)
        await self._attempts(ex, view)
        await call_next(ex)

    async def _tokens(self, ex: Exchange) -> list[int] | None:
        """The prompt's token ids, when an endpoint of its model announces its cache (KV
        events) and the request shares the default cache partition: counted by a backend of
        the model within `TOKENIZE_TIMEOUT_S` (None: routing goes by what answers taught)."""
        assert ex.parsed is not None and ex.model is not None
        if ex.namespace or not self.router.wants_tokens(ex.model):
            return None
        body = self._prompt_body(ex)
        try:
            async with asyncio.timeout(TOKENIZE_TIMEOUT_S):
                return await self.router.tokenizer_for(ex.model).tokenize(
                    {**body, "model": ex.model})
        except (TimeoutError, ApiError):
            return None

    @staticmethod
    def _prompt_body(ex: Exchange) -> dict:
        """The body whose prompt goes on (the window stage counts the same object)."""
        assert ex.parsed is not None
        return ex.prepared.body if ex.prepared is not None else ex.parsed.body

    async def _attempts(self, ex: Exchange, view: RouteView) -> Attempt:
        """Attempts until one was answered (or failed in a way another backend cannot fix)."""
        refused: list[str] = []
        restarted = False
        kept: Attempt | None = None
        while True:
            attempt, view = await self._start(ex, view, refused, kept)
            kept = None
            try:
                await self.router.begin(view, attempt, ex.trace.request_id)
                try:
                    await self._run_attempt(ex)
                    if attempt.completed:   # learned before it ends: no request routed in
                        self.router.learn(view, attempt)   # between sees neither
                finally:
                    await self.router.end(attempt)
                return attempt
            except BackendGone as e:
                name = attempt.decision.name
                self.router.forget(name)
                refused.append(name)
                if len(refused) >= len(self.router.index[view.model]):
                    # none left but a managed worker that restarts itself: once, its successor
                    # (holding its queue slot: it keeps its place before those behind it)
                    if restarted or not await self.router.restarted(name):
                        raise ApiError(502, str(e), code="upstream_error") from None
                    restarted = True
                    refused.remove(name)
                    kept = attempt
            finally:
                ex.trace.queue_wait = attempt.queue_wait
                if kept is None:
                    attempt.release()

    async def _start(self, ex: Exchange, view: RouteView, refused: list[str],
                     kept: Attempt | None) -> tuple[Attempt, RouteView]:
        """The next attempt, and the request's view of the index for it (read again after
        waiting for a prefix another request was computing: it is held now); `kept`: the
        attempt before, on the backend this one gets again (its restarted worker), whose
        queue slot it takes over."""
        decision = self.router.decide(view, exclude=refused)
        if not refused and await self.router.wait_for_prefix(view, decision.name):
            view = self.router.view(view.model, view.lane, view.chain, ex.prompt_ids)
        translator = ex.api.translator
        ex.attempt = Attempt(decision, self.router.backends[decision.name], view.model,
                             again=bool(refused) or kept is not None,
                             slot=kept.slot if kept is not None else None,
                             queue_wait=kept.queue_wait if kept is not None else None,
                             stream_out=translator.stream(ex.client_body)
                             if translator and ex.stream
                             else None,
                             transfer=self.router.transfer_plan(view, decision.name))
        ex.trace.backend = decision.name
        if ex.prompt_ids is not None:
            ex.attempt.counted(self._prompt_body(ex), ex.prompt_ids)
        ex.attempt.prompt_tokens = self.router.prompt_size(view)
        report = ex.prepared.report if ex.prepared is not None else None
        if report is not None:
            report.predicted_cached_tokens = decision.predicted
            report.predicted_from = "kv_events" if decision.name in view.via_events \
                else "answers"
        return ex.attempt, view
