"""relay: answer the client from the upstream response — SSE event by event, or the JSON
body as it arrives — through the client API's translator when it has one; note time to
first token, and the attempt's answer: the assistant message and the upstream's `usage`,
parsed here once (`prefixd.api.usage.Usage`) for routing, the prefix report and the trace.
The backend's 200 makes the request its lane's newest turn (`PrefixTracker.commit`); its
error leaves the lane as it was.

A stream's events before its first generated content (a role-only chunk) are held back until
that content: an upstream that dies before it (a worker killed during its prefill) has sent
the client nothing of the answer, so the route stage makes another attempt on another backend
(`BackendGone`) and the client gets one whole answer."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from prefixd.api.errors import ApiError
from prefixd.backends.base import BackendError, BackendGone, BackendTimeout
from prefixd.proxy.exchange import SSE_HEADERS, Exchange, ResponseState
from prefixd.proxy.prefix.tracker import PrefixTracker
from prefixd.proxy.sse import SSERecorder, UpstreamProtocolError, loads, parse_json_body
from prefixd.proxy.stages import Next

MAX_ERROR_BODY = 1 << 20
_DROP = ("server", "date", "content-length", "content-type")


class RelayStage:
    name = "relay"

    def __init__(self, prefix: PrefixTracker) -> None:
        self.prefix = prefix

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        assert ex.attempt is not None and ex.parsed is not None
        up = ex.attempt.upstream
        assert up is not None
        ex.trace.upstream_status = up.status
        is_sse = up.headers.get("Content-Type", "").startswith("text/event-stream")
        try:
            if up.status != 200:
                await self._error(ex)
            else:
                if ex.prepared is not None:      # accepted: the request is its lane's turn
                    self.prefix.commit(ex.prepared)
                await (self._sse(ex) if is_sse else self._json(ex))
        except UpstreamProtocolError as e:
            raise ApiError(502, f"backend {ex.trace.backend!r}: {e}",
                           code="upstream_error") from None
        await call_next(ex)

    async def _error(self, ex: Exchange) -> None:
        """An upstream's own error: passed through as it is to an OpenAI client that has
        no response yet; otherwise in the client API's error shape."""
        assert ex.attempt is not None
        up = ex.attempt.upstream
        assert up is not None
        body = await _read(up.chunks, MAX_ERROR_BODY)
        if ex.state is not ResponseState.NOT_STARTED or ex.api.translator is not None:
            raise upstream_error(up.status, loads(body), body)
        resp = await ex.start(up.status, _headers(up.headers, "application/json"), sse=False)
        ex.trace.status = up.status
        await resp.write(body)
        await _end(ex)

    async def _sse(self, ex: Exchange) -> None:
        attempt = ex.attempt
        assert attempt is not None and ex.parsed is not None
        up = attempt.upstream
        assert up is not None
        if ex.state is ResponseState.NOT_STARTED:
            headers = (SSE_HEADERS if ex.api.translator is not None
                       else _headers(up.headers, up.headers.get("Content-Type", "")))
            await ex.start(200, headers, sse=True)
        elif ex.state is not ResponseState.SSE:
            raise AssertionError("a JSON response cannot carry a stream")
        resp = ex.response
        assert resp is not None
        ex.trace.status = 200
        if attempt.stream_out is not None:
            attempt.stream_out.prompt_tokens = attempt.prompt_tokens
        rec = SSERecorder(strip_usage=ex.stream and not ex.parsed.req.wants_usage,
                          translate=attempt.stream_out)
        held = bytearray()     # what precedes the answer (a role-only chunk): held back

        def answering() -> bool:
            return rec.first_content_at is not None or rec.done

        try:
            async for chunk in up.chunks:
                out = rec.feed(chunk)
                notes = rec.take_notes()     # a worker's place in line: on at once
                if notes:
                    await resp.write(notes)
                if out and not answering():
                    held += out
                elif out or held:
                    await resp.write(bytes(held) + out)
                    held.clear()
                if rec.done and not ex.trace.completed and ex.api.translator is None:
                    # The client has every byte that matters: whatever it does next (close
                    # at once, say), this request completed, with its usage.
                    ex.trace.completed = True
                    ex.trace.first_token_at = rec.first_content_at
                    attempt.usage = ex.trace.usage = rec.usage
        except BackendError as e:
            if answering() or isinstance(e, BackendTimeout):
                raise
            # Nothing of the answer reached the client: another attempt may give it whole.
            raise BackendGone(f"{e} (before any of the answer was sent)") from e
        tail = bytes(held) + rec.flush()
        if rec.error is not None or not rec.ended:
            await self._cut(ex, rec, tail if answering() else b"")
        if attempt.stream_out is not None:
            tail += attempt.stream_out.finish()
        if tail:
            await resp.write(tail)
        ex.trace.first_token_at = rec.first_content_at
        attempt.message, attempt.usage = rec.builder.message(), rec.usage
        await _end(ex)

    async def _cut(self, ex: Exchange, rec: SSERecorder, sent: bytes) -> None:
        """The upstream stopped before the answer's end: it said so in-band (an error event:
        it failed, or was stopped), or the stream ended with neither a finish reason nor
        `[DONE]` (its process stopped). The client is told it was cut short, in its API's own
        way (`Exchange.fail`): never a completion. With nothing of the answer sent yet, and no
        error of the upstream's own, another attempt may give the answer whole."""
        if rec.error is not None:
            error = upstream_error(502, rec.error)
        elif not sent and rec.first_content_at is None:
            raise BackendGone(f"backend {ex.trace.backend!r} ended the stream before any of "
                              "the answer")
        else:
            error = ApiError(502, f"backend {ex.trace.backend!r} ended the stream before the "
                             "answer's end (no finish reason, no [DONE]): the answer is cut "
                             "short", code="upstream_error")
        if sent:
            assert ex.response is not None
            await ex.response.write(sent)      # what the upstream sent before it stopped
        raise error

    async def _json(self, ex: Exchange) -> None:
        attempt = ex.attempt
        assert attempt is not None
        up = attempt.upstream
        assert up is not None
        if ex.state is ResponseState.SSE:        # a queued stream, but the upstream did not
            body = await _read(up.chunks, MAX_ERROR_BODY)
            raise ApiError(502, "the upstream answered a streaming request with "
                           f"{up.headers.get('Content-Type') or 'no content type'}: "
                           f"{body[:200].decode(errors='replace')}", code="upstream_error")
        if ex.api.translator is not None:
            body = await _read(up.chunks, None)
            obj = loads(body)
            if not isinstance(obj, dict):
                raise ApiError(502, "the upstream's answer is not a JSON object",
                               code="upstream_error")
            ex.trace.first_token_at = time.monotonic()
            attempt.message, attempt.usage = parse_json_body(body)
            out = json.dumps(ex.api.translator.response(obj, ex.client_body),
                             ensure_ascii=False).encode()
            resp = await ex.start(200, {"Content-Type": "application/json"}, sse=False)
            ex.trace.status = 200
            await resp.write(out)
            await _end(ex)
            return
        resp = await ex.start(200, _headers(up.headers, "application/json"), sse=False)
        ex.trace.status = 200
        parts = []
        async for chunk in up.chunks:
            if ex.trace.first_token_at is None:
                ex.trace.first_token_at = time.monotonic()
            parts.append(chunk)
            await resp.write(chunk)
        attempt.message, attempt.usage = parse_json_body(b"".join(parts))
        await _end(ex)


async def _end(ex: Exchange) -> None:
    """The last byte of the answer is sent: a 200 answer completes its attempt."""
    assert ex.response is not None and ex.attempt is not None
    await ex.response.write_eof()
    ex.trace.completed = True
    ex.attempt.completed = ex.trace.status == 200


def _headers(upstream: dict[str, str], content_type: str) -> dict[str, str]:
    out = {k: v for k, v in upstream.items() if k.lower() not in _DROP}
    out["Content-Type"] = content_type or "application/octet-stream"
    return out


async def _read(chunks: AsyncIterator[bytes], limit: int | None) -> bytes:
    parts, size = [], 0
    async for chunk in chunks:
        parts.append(chunk)
        size += len(chunk)
        if limit is not None and size > limit:
            break
    return b"".join(parts)[: limit or None]


def upstream_error(status: int, obj: object, raw: bytes = b"") -> ApiError:
    """An upstream's error body (`{"error": {...}}` or `{"error": "..."}`) as ours, keeping
    what it said: its message, type, parameter and code (else `upstream_error`)."""
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, str):
        return ApiError(status, err, code="upstream_error")
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return ApiError(status, f"upstream answered HTTP {status}: "
                        f"{raw[:200].decode(errors='replace')}", code="upstream_error")

    def text(key: str) -> str | None:
        value = err.get(key)
        return value if isinstance(value, str) and value else None

    return ApiError(status, err["message"], param=text("param"),
                    code=text("code") or "upstream_error", type_=text("type"))
