"""forward: start the backend if needed, send it the final request bytes (with a slot pin
where the router's slot planner has one), and keep the upstream response open while relay
reads it (leaving early closes the upstream request)."""

from __future__ import annotations

import json

from prefixd.api.errors import ApiError
from prefixd.api.schema import CHAT_PATH, COMPLETIONS_PATH, NAMESPACE_HEADER
from prefixd.backends.base import (
    Backend,
    BackendError,
    BackendGone,
    BackendTimeout,
    BackendUnavailable,
    UpstreamRequest,
)
from prefixd.proxy.bodies import with_field
from prefixd.proxy.exchange import Exchange
from prefixd.proxy.routing.router import Router
from prefixd.proxy.stages import Next


class ForwardStage:
    name = "forward"

    def __init__(self, router: Router, request_timeouts: dict[str, float]) -> None:
        self.router = router
        self.request_timeouts = request_timeouts

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        assert ex.attempt is not None and ex.parsed is not None
        attempt = ex.attempt
        backend = attempt.backend
        try:
            await backend.ensure_ready()
            path = CHAT_PATH if ex.api.kind == "chat" else COMPLETIONS_PATH
            body = await self.router.pin(attempt, forward_body(ex), ex.trace.request_id)
            up_req = UpstreamRequest(path=path, body=body,
                                     stream=ex.stream, request_id=ex.trace.request_id,
                                     headers=namespace_headers(ex, backend),
                                     timeout_s=self.request_timeouts[backend.name])
            async with backend.forward(up_req) as up:
                attempt.upstream = up
                await call_next(ex)
        except BackendUnavailable as e:
            raise ApiError(503, str(e), code="backend_unavailable") from None
        except BackendGone:
            raise           # nothing was sent: the route stage may send it elsewhere
        except BackendTimeout as e:
            raise ApiError(504, str(e), code="upstream_timeout") from None
        except BackendError as e:
            raise ApiError(502, str(e), code="upstream_error") from None


def namespace_headers(ex: Exchange, backend: Backend) -> dict[str, str]:
    """The request's cache partition, for a backend that keeps partitions apart."""
    if ex.namespace and backend.capabilities.partitions_cache:
        return {NAMESPACE_HEADER: ex.namespace}
    return {}


def forward_body(ex: Exchange) -> bytes:
    """The bytes the backend receives: the client's own bytes unless a stage changed the
    body, with the served model's name in place of an omitted or aliased one, `max_tokens`
    cut to the window's room (the window stage's clamp) and stream usage requested."""
    assert ex.parsed is not None
    body, raw = ex.parsed.body, ex.parsed.raw
    if ex.prepared is not None and ex.prepared.changed:
        body = ex.prepared.body
    if ex.parsed.req.model != ex.model:           # omitted (the only one), or an alias
        body = {**body, "model": ex.model}
    clamp = ex.attempt.clamp if ex.attempt is not None else None
    if clamp is not None:
        body = {**body, **{k: min(v, clamp.sent) for k in ("max_tokens", "max_completion_tokens")
                           if isinstance(v := body.get(k), int)}}
    if body is not ex.parsed.body:                # untouched bodies keep the client's bytes
        raw = json.dumps(body, ensure_ascii=False).encode()
    if ex.stream and not ex.parsed.req.wants_usage:
        raw = with_stream_usage(raw, body)
    return raw


def with_stream_usage(raw: bytes, body: dict) -> bytes:
    """The same request asking the upstream for stream usage, other bytes untouched (the key
    spliced in first, so the client's bytes and their order are forwarded as sent)."""
    if "stream_options" in body:
        opts = dict(body["stream_options"] or {})
        opts["include_usage"] = True
        return json.dumps({**body, "stream_options": opts}, ensure_ascii=False).encode()
    return with_field(raw, "stream_options", {"include_usage": True})
