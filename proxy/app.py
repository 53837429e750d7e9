"""The aiohttp application: routes, the error/auth middleware, and the informational
endpoints (/v1/models, /health, /ready, /status, /metrics, /debug/prefix); the status page
at / comes from `prefixd.proxy.ui`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

from prefixd import metrics
from prefixd.api.errors import ApiError, errors_middleware
from prefixd.backends.base import BackendState
from prefixd.metrics.federate import label_worker_metrics
from prefixd.proxy.apis import API_BY_PATH, CLIENT_APIS
from prefixd.proxy.keys import Viewer, is_key, viewer
from prefixd.proxy.pipeline import Proxy
from prefixd.proxy.routing.follow import streams_of
from prefixd.proxy.tokens import count_tokens
from prefixd.proxy.ui import add_routes as add_ui_routes

log = logging.getLogger("prefixd.app")

PROXY_KEY = web.AppKey("proxy", Proxy)
WARMUPS_KEY = web.AppKey("warmups", list)
OPERATOR_KEY = web.AppKey("operator_key", str)
EVERYTHING = Viewer(None)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def needs_key(path: str) -> bool:
    """Routes that reveal traffic (the API, status, metrics, prefix reports) need the key;
    /health, /ready and the status page's own files (/, /ui/*) stay open."""
    return path.startswith(("/v1/", "/debug/")) or path in ("/status", "/metrics")


def auth_middleware(api_key: str | None, operator_key: str | None = None) -> Callable:
    """With an API key, the routes that reveal traffic need it (or the operator key)."""

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (api_key and needs_key(request.path) and not is_key(request.headers, api_key)
                and not is_key(request.headers, operator_key)):
            e = ApiError(401, "missing or wrong API key (Authorization: Bearer ... or "
                         "x-api-key)", code="invalid_api_key")
            api = API_BY_PATH.get(request.path.removesuffix("/count_tokens"))
            if api is None:
                raise e
            return web.json_response(api.error_body(e), status=401)
        return await handler(request)
    return auth


def body_limit_middleware(limit: int) -> Callable:
    @web.middleware
    async def body_limit(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"request body of {request.content_length} bytes is larger "
                           f"than max_body_bytes={limit}", code="request_too_large")
        return await handler(request)
    return body_limit


async def _model_entry(proxy: Proxy, model: str, now: int) -> dict:
    """One served model: its backends, their state and footprint (managed ones), and its
    context window (`context_length`: the smallest its backends know, the one a client can
    count on)."""
    names = proxy.index[model]
    states = {n: proxy.backends[n].status().state for n in names}
    entry: dict = {"id": model, "object": "model", "created": now, "owned_by": "prefixd",
                   "backends": names, "state": _model_state(states.values())}
    windows = [w for w in await asyncio.gather(
        *(proxy.backends[n].context_window() for n in names)) if w is not None]
    if windows:
        entry["context_length"] = min(windows)
    if proxy.pool is not None:
        sizes = [proxy.pool.footprints[n] for n in names if n in proxy.pool.footprints]
        if sizes:
            entry["footprint_bytes"] = max(sizes)
    return entry


_MODEL_STATES = (("loaded", {BackendState.READY, BackendState.UNKNOWN}),
                 ("loading", {BackendState.STARTING}),
                 ("unloaded", {BackendState.STOPPED, BackendState.STOPPING, BackendState.DOWN}))


def _model_state(states: Iterable[BackendState]) -> str:
    """loaded / loading / unloaded / failed, from its backends' states."""
    have = set(states)
    return next((label for label, match in _MODEL_STATES if have & match), "failed")


async def _models(request: web.Request) -> web.Response:
    proxy = request.app[PROXY_KEY]
    now = int(time.time())
    return web.json_response({"object": "list",
                              "data": [await _model_entry(proxy, m, now)
                                       for m in proxy.index]})


async def _model(request: web.Request) -> web.Response:
    proxy = request.app[PROXY_KEY]
    model = request.match_info["model"]
    if model not in proxy.index:
        raise ApiError(404, f"model {model!r} is not served here; available: "
                       f"{sorted(proxy.index)}", param="model", code="model_not_found")
    return web.json_response(await _model_entry(proxy, model, int(time.time())))


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _hello(request: web.Request) -> web.Response:
    """Claude Code's reachability probe of its base URL (`HEAD /api/hello`): we are here."""
    return web.json_response({})


def _statuses(proxy: Proxy, who: Viewer = EVERYTHING) -> list[dict]:
    """Every backend's state and queue; of its routing index, only the conversations `who`
    may see."""
    out = []
    for name, backend in proxy.backends.items():
        st = backend.status()
        q = proxy.queues[name]
        out.append({"name": name, "kind": st.kind, "state": st.state, "up": st.up,
                    "models": st.models, "queue_depth": q.waiting, "in_flight": q.in_flight,
                    "max_concurrency": q.max_concurrency, **q.recent_waits(),
                    "last_error": st.last_error,
                    **proxy.router.status(name, who.sees),
                    **(proxy.pool.status(name) if proxy.pool and name in proxy.pool.backends
                       else {}), **st.detail})
    return out


def cache_summary(info: dict | None) -> dict | None:
    """The part of a worker's /v1/cache that the status page shows."""
    if not info:
        return None
    entries = info.get("entries")
    return {"bytes_used": info.get("bytes_used"), "budget": info.get("bytes_budget"),
            "entries": len(entries) if isinstance(entries, list) else entries,
            "checkpoints": info.get("checkpoints"),
            "hit_tokens_total": info.get("hit_tokens_total"),
            "recomputed_tokens_total": info.get("recomputed_tokens_total"),
            "misses": info.get("misses") or {},
            "group": info.get("group"),
            "batch": info.get("batch"),
            "speculative": info.get("speculative"),
            "disk": _disk_summary(info.get("disk"))}


def _disk_summary(disk: object) -> dict | None:
    """A worker's disk tier (null when it has none)."""
    if not isinstance(disk, dict):
        return None
    return {"bytes_used": disk.get("bytes_used"), "budget": disk.get("bytes_budget"),
            "records": disk.get("records"), "written_bytes": disk.get("written_bytes"),
            "skipped_files": disk.get("skipped_files") or {}}


async def _ready(request: web.Request) -> web.Response:
    statuses = _statuses(request.app[PROXY_KEY])
    ready = [s["name"] for s in statuses if s["state"] == BackendState.READY]
    body = {"ready": bool(ready), "backends": {s["name"]: {"state": s["state"],
                                                           "last_error": s["last_error"]}
                                               for s in statuses}}
    return web.json_response(body, status=200 if ready else 503)


async def _status(request: web.Request) -> web.Response:
    """Every backend's state, queue and cache; under a memory budget, each managed model's
    footprint (`footprint_bytes`, `footprint_source`) and `model_memory`: the budget and
    what the loaded models hold of it."""
    proxy = request.app[PROXY_KEY]
    names = list(proxy.backends)
    infos = await asyncio.gather(*(proxy.backends[n].cache_info() for n in names))
    if proxy.pool is not None:
        for name, info in zip(names, infos, strict=True):
            proxy.pool.observe(name, info)       # a loaded worker's measured footprint
    statuses = _statuses(proxy, _viewer(request))
    for status, info in zip(statuses, infos, strict=True):
        status["cache"] = cache_summary(info)
    body: dict = {"backends": statuses}
    if proxy.pool is not None:
        body["model_memory"] = proxy.pool.summary()
    return web.json_response(body)


def _viewer(request: web.Request) -> Viewer:
    """What this caller may see (`keys.viewer`)."""
    return viewer(request.headers, request.app[PROXY_KEY].settings.cache_isolation,
                  request.app.get(OPERATOR_KEY))


async def _metrics(request: web.Request) -> web.Response:
    """Every key's traffic: under per-key isolation the operator's only (403 otherwise)."""
    if not _viewer(request).operator:
        raise ApiError(403, "under PREFIXD_CACHE_ISOLATION=per_key, /metrics (every key's "
                       "traffic) needs the operator key (PREFIXD_OPERATOR_KEY)",
                       type_="permission_error", code="operator_only")
    proxy = request.app[PROXY_KEY]
    if proxy.pool is not None:
        proxy.pool.publish()                    # which models are loaded now
    names = list(proxy.backends)
    texts = await asyncio.gather(*(proxy.backends[n].metrics_text() for n in names))
    workers = label_worker_metrics({n: t for n, t in zip(names, texts, strict=True) if t})
    resp = web.Response(body=metrics.render() + workers.encode())
    resp.headers["Content-Type"] = metrics.CONTENT_TYPE
    return resp


async def _debug_lanes(request: web.Request) -> web.Response:
    proxy = request.app[PROXY_KEY]
    if not proxy.detecting:
        raise ApiError(404, "prefix detection is off (PREFIXD_PREFIX_DETECT=false)")
    return web.json_response({"lanes": proxy.prefix.debug_lanes(_viewer(request).sees)})


async def _debug_lane(request: web.Request) -> web.Response:
    proxy = request.app[PROXY_KEY]
    history = (proxy.prefix.debug_lane(request.match_info["lane"], _viewer(request).sees)
               if proxy.detecting else None)
    if history is None:
        raise ApiError(404, f"no lane {request.match_info['lane']!r}", code="lane_not_found")
    return web.json_response({"lane": request.match_info["lane"], "reports": history})


async def _start_backends(app: web.Application) -> None:
    proxy = app[PROXY_KEY]

    async def warm(name: str) -> None:
        try:
            await proxy.backends[name].ensure_ready()
        except Exception as e:  # reported through /status and to requests
            log.warning("backend %s not ready at start-up: %s", name, e)

    # Under a memory budget, only what fits together starts now, one after another (the
    # pool measures each); the rest load on demand.
    names = [n for n in proxy.backends if proxy.pool is None or n not in proxy.pool.backends]
    app[WARMUPS_KEY] = [asyncio.create_task(warm(n)) for n in names]
    if proxy.pool is not None:
        app[WARMUPS_KEY].append(asyncio.create_task(proxy.pool.warm()))
    await proxy.router.follow.set(streams_of(proxy.settings.backends))   # their KV events


async def _stop_backends(app: web.Application) -> None:
    await app[PROXY_KEY].router.follow.close()
    for task in app.get(WARMUPS_KEY, []):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    for backend in app[PROXY_KEY].backends.values():
        with contextlib.suppress(Exception):
            await backend.stop()


def build_app(proxy: Proxy) -> web.Application:
    s = proxy.settings
    key = s.api_key.get_secret_value() if s.api_key else None
    operator = s.operator_key.get_secret_value() if s.operator_key else None
    app = web.Application(client_max_size=s.max_body_bytes,
                          middlewares=[errors_middleware, auth_middleware(key, operator),
                                       body_limit_middleware(s.max_body_bytes)])
    app[PROXY_KEY] = proxy
    if operator:
        app[OPERATOR_KEY] = operator
    for api in CLIENT_APIS:
        app.router.add_post(api.path, proxy.handler(api))
    app.router.add_post("/v1/messages/count_tokens", count_tokens(proxy))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/api/hello", _hello)             # GET and HEAD
    app.router.add_get("/ready", _ready)
    app.router.add_get("/status", _status)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/debug/prefix", _debug_lanes)
    app.router.add_get("/debug/prefix/{lane:.+}", _debug_lane)    # ids hold "/"
    add_ui_routes(app)
    app.on_startup.append(_start_backends)
    app.on_cleanup.append(_stop_backends)
    return app
