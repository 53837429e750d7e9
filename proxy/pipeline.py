"""The request pipeline for /v1/chat/completions and /v1/completions, stage by stage:

    parse → prefix (lane, mutations, canonicalize) → route → queue → ensure_ready → forward
    → relay (SSE chunk by chunk) → record the answer for the lane → metrics + one log line

`Proxy` owns the backends, their queues and the lane→backend affinity map.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from prefixd.api.errors import ApiError
from prefixd.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    UpstreamRequest,
    UpstreamResponse,
)
from prefixd.proxy.prefix.stage import PrefixStage, Prepared
from prefixd.proxy.queue import BackendQueue, QueueClosed, QueueFull, QueueTimeout
from prefixd.proxy.relay import SSERecorder, parse_json_body
from prefixd.proxy.request import ClientRequest, parse, with_stream_usage
from prefixd.proxy.route import AffinityMap, Candidate, choose, models_index, resolve_model
from prefixd.proxy.settings import BackendConfig, Settings
from prefixd.proxy.trace import RequestTrace

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}


class Proxy:
    def __init__(self, settings: Settings, backends: list[Backend],
                 configs: dict[str, BackendConfig], stage: PrefixStage | None = None) -> None:
        self.settings = settings
        self.backends = {b.name: b for b in backends}
        self.configs = configs
        self.queues = {b.name: BackendQueue(b.name, configs[b.name].max_concurrency,
                                            configs[b.name].queue_depth,
                                            configs[b.name].queue_timeout_s)
                       for b in backends}
        self.index = models_index({b.name: b.models for b in backends})
        self.affinity = AffinityMap()
        self.stage = stage

    # --- routing -------------------------------------------------------------------------
    def _route(self, model: str, lane: str | None) -> Backend:
        names = self.index[model]
        cands = [Candidate(n, _available(self.backends[n]),
                           self.queues[n].waiting + self.queues[n].in_flight,
                           self.configs[n].max_concurrency) for n in names]
        picked = choose(cands, self.affinity.get(lane)).name
        self.affinity.set(lane, picked)
        return self.backends[picked]

    # --- the handler ---------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        trace = RequestTrace(request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16])
        try:
            return await self._handle(request, trace)
        except ApiError as e:
            trace.status, trace.error = e.status, e.message
            if trace.response is not None:       # SSE already started: error as an event
                await _send_sse_error(trace.response, e)
                return trace.response
            resp = e.response()
            resp.headers["X-Request-Id"] = trace.request_id
            return resp
        except (asyncio.CancelledError, ConnectionResetError) as e:
            if not trace.completed:              # the client left before the answer ended
                trace.status, trace.error = 499, f"client went away ({type(e).__name__})"
            raise
        except Exception as e:
            trace.status, trace.error = 500, f"internal error: {e!r}"
            raise
        finally:
            trace.finish(self.settings.log_format)

    async def _handle(self, request: web.Request, trace: RequestTrace) -> web.StreamResponse:
        creq = parse(request.path, await _read_body(request))
        model = resolve_model(creq.model, self.index)
        if model is None:
            if creq.model is None:
                raise ApiError(400, "'model' is required: this proxy serves "
                               f"{sorted(self.index)}", param="model", code="missing_field")
            raise ApiError(404, f"model {creq.model!r} is not served here; available: "
                           f"{sorted(self.index)}", param="model", code="model_not_found",
                           type_="invalid_request_error")
        trace.model = model
        prepared = None
        if self.stage is not None:
            prepared = self.stage.prepare(creq.body, request.headers, model=model,
                                          path=creq.path, backend_kind="local")
        backend = self._route(model, prepared.lane if prepared else None)
        trace.backend = backend.name
        body = self._forward_body(creq, prepared, model)
        queue = self.queues[backend.name]

        on_position = None
        if creq.stream and queue.would_wait() and not queue.full():
            trace.response = await self._start_sse(request, trace, prepared)

            async def on_position(pos: int) -> None:
                await trace.response.write(f": queued position={pos}\n\n".encode())
        try:
            async with queue.slot(on_position) as waited:
                trace.queue_wait = waited
                await backend.ensure_ready()
                if prepared is not None and prepared.report and self.stage is not None:
                    # exact token offsets where the backend can tokenize (optional member)
                    await self.stage.measure(prepared, getattr(backend, "tokenize", None))
                up_req = UpstreamRequest(path=creq.path, body=body, stream=creq.stream,
                                         request_id=trace.request_id,
                                         timeout_s=self.configs[backend.name].request_timeout_s)
                async with backend.forward(up_req) as up:
                    return await self._relay(request, trace, creq, up, prepared)
        except QueueFull:
            raise ApiError(429, f"backend {backend.name!r} queue is full "
                           f"({queue.depth} waiting); retry later", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except QueueTimeout:
            raise ApiError(503, f"waited {queue.timeout_s:g}s in the queue of backend "
                           f"{backend.name!r} without getting a slot",
                           code="queue_timeout") from None
        except QueueClosed:
            raise ApiError(503, "prefixd is shutting down", code="shutting_down") from None
        except BackendUnavailable as e:
            raise ApiError(503, str(e), code="backend_unavailable") from None
        except BackendError as e:
            raise ApiError(502, str(e), code="upstream_error") from None

    def _forward_body(self, creq: ClientRequest, prepared: Prepared | None, model: str) -> bytes:
        body, raw = creq.body, creq.raw
        if prepared is not None and prepared.changed:
            body = prepared.body
        if creq.model is None:                   # an omitted model means the only one
            body = {**body, "model": model}
        if body is not creq.body:                # untouched bodies keep the client's bytes
            raw = json.dumps(body, ensure_ascii=False).encode()
        if creq.stream and not creq.wants_usage:
            raw = with_stream_usage(raw, body)
        return raw

    async def _start_sse(self, request: web.Request, trace: RequestTrace,
                         prepared: Prepared | None) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        self._decorate(resp, trace, prepared)
        await resp.prepare(request)
        return resp

    def _decorate(self, resp: web.StreamResponse, trace: RequestTrace,
                  prepared: Prepared | None) -> None:
        resp.headers["X-Request-Id"] = trace.request_id
        if trace.backend:
            resp.headers["X-Prefixd-Backend"] = trace.backend
        if prepared is not None and prepared.header:
            resp.headers["X-Prefixd-Prefix"] = prepared.header

    async def _relay(self, request: web.Request, trace: RequestTrace, creq: ClientRequest,
                     up: UpstreamResponse, prepared: Prepared | None,
                     ) -> web.StreamResponse:
        is_sse = up.headers.get("Content-Type", "").startswith("text/event-stream")
        if trace.response is not None and up.status != 200:   # queued stream, upstream refused
            body = b"".join([c async for c in up.chunks])
            raise ApiError(up.status, _error_message(body, up.status), code="upstream_error")
        resp = trace.response
        if resp is None:
            headers = {k: v for k, v in up.headers.items()
                       if k.lower() not in ("server", "date", "content-length")}
            resp = web.StreamResponse(status=up.status, headers=headers)
            self._decorate(resp, trace, prepared)
            await resp.prepare(request)
            trace.response = resp
        trace.status = up.status
        if is_sse:
            rec = SSERecorder(strip_usage=creq.stream and not creq.wants_usage)
            async for chunk in up.chunks:
                out = rec.feed(chunk)
                if out:
                    await resp.write(out)
            tail = rec.flush()
            if tail:
                await resp.write(tail)
            trace.first_token_at = rec.first_content_at
            message, usage = rec.builder.message(), rec.usage
        else:
            parts = []
            async for chunk in up.chunks:
                parts.append(chunk)
                await resp.write(chunk)
            message, usage = parse_json_body(b"".join(parts))
            trace.first_token_at = time.monotonic()
        await resp.write_eof()
        trace.completed = True
        trace.usage = usage
        if self.stage is not None and prepared is not None and up.status == 200:
            self.stage.record_response(prepared, message, usage)
        return resp


async def _read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPException:
        raise                                    # 413 and friends: the middleware shapes them
    except (ValueError, RequestPayloadError, HttpProcessingError) as e:
        raise ApiError(400, f"could not read the request body: {e}",
                       code="invalid_body") from None


def _available(backend: Backend) -> bool:
    """Up, or a managed worker that ensure_ready() would start (stopped/idle-unloaded)."""
    st = backend.status()
    return st.up or st.state in ("stopped", "starting")


def _error_message(body: bytes, status: int) -> str:
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError):
        pass
    return f"upstream answered HTTP {status}: {body[:200].decode(errors='replace')}"


async def _send_sse_error(resp: web.StreamResponse, e: ApiError) -> None:
    try:
        await resp.write(e.sse_event())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionResetError, OSError):
        pass
