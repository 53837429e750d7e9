"""route: the requested model → its backends → one of them (policy in `proxy/route.py`)."""

from __future__ import annotations

from prefixd.api.errors import ApiError
from prefixd.backends.base import Backend
from prefixd.proxy.exchange import Exchange
from prefixd.proxy.queue import BackendQueue
from prefixd.proxy.route import AffinityMap, Candidate, choose, resolve_model
from prefixd.proxy.stages import Next


class RouteStage:
    name = "route"

    def __init__(self, backends: dict[str, Backend], queues: dict[str, BackendQueue],
                 index: dict[str, list[str]], aliases: dict[str, str] | None = None) -> None:
        self.backends, self.queues, self.index = backends, queues, index
        self.aliases = aliases or {}
        self.affinity = AffinityMap()

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        assert ex.parsed is not None
        ex.model = ex.trace.model = self.model_for(ex.parsed.req.model)
        lane = ex.prepared.lane if ex.prepared is not None else None
        ex.backend = self.pick(ex.model, lane)
        ex.trace.backend = ex.backend.name
        await call_next(ex)

    def model_for(self, requested: str | None) -> str:
        """The served model for a request's `model`; 400/404 naming what is served."""
        model = resolve_model(requested, self.index, self.aliases)
        if model is not None:
            return model
        if requested is None:
            raise ApiError(400, "'model' is required: this proxy serves "
                           f"{sorted(self.index)}", param="model", code="missing_field")
        raise ApiError(404, f"model {requested!r} is not served here; available: "
                       f"{sorted(self.index)} (PREFIXD_MODEL_ALIASES maps other names)",
                       param="model", code="model_not_found", type_="invalid_request_error")

    def pick(self, model: str, lane: str | None) -> Backend:
        cands = []
        for n in self.index[model]:
            q = self.queues[n]
            cands.append(Candidate(n, self.backends[n].status().available,
                                   q.waiting + q.in_flight, q.max_concurrency))
        picked = choose(cands, self.affinity.get(lane)).name
        self.affinity.set(lane, picked)
        return self.backends[picked]
