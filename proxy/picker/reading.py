"""A request as the picker reads it, and what its answer teaches: the same parsing as
`prefixd serve`'s (the client API's translator, the shared schema, lanes, mutation reports,
canonicalization where enabled), and the usage each client API reports in its answer.

Owns nothing between calls but what one request carries (`Ask`) and one answer's scan
(`UsageScan`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefixd.api.errors import ApiError
from prefixd.api.schema import decode_json, validate
from prefixd.api.usage import Usage
from prefixd.api.values import count
from prefixd.proxy.apis import API_BY_PATH
from prefixd.proxy.exchange import ClientApi
from prefixd.proxy.prefix.tracker import PrefixTracker, Prepared
from prefixd.proxy.routing.core import RouteView, RoutingCore
from prefixd.proxy.routing.index import boundaries
from prefixd.proxy.stages.translate import translate_request

MAX_SCAN = 16 * 2**20   # bytes of a non-streamed answer read for its usage, at most


@dataclass
class Ask:
    """One request read: its client API (None: a path the picker does not read, routed by
    nothing but load), its routing view, its prefix state, and its body when rewritten
    (canonicalized; None: forwarded as the client sent it)."""

    api: ClientApi | None
    view: RouteView | None = None
    prepared: Prepared | None = None
    body: bytes | None = None
    stream: bool = False


def api_for(path: str) -> ClientApi | None:
    """The client API a request path is (None: one the picker does not read)."""
    return API_BY_PATH.get(path.split("?", 1)[0])


def read(path: str, raw: bytes, headers: Mapping[str, str], core: RoutingCore,
         tracker: PrefixTracker, namespace: str) -> Ask:
    """Read a request (ApiError: a 4xx in the client API's shape, `Ask.api` to shape it). Its
    mutation report is not made here: after the pick (`extproc.Exchange.detect`)."""
    api = api_for(path)
    if api is None:
        return Ask(None)
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_body")
    chat = body if api.translator is None else translate_request(api.translator, body)
    req = validate(api.kind, chat)
    model = core.model_for(req.model)
    prepared = tracker.canonicalize(chat, headers, namespace)
    view = core.view(model, prepared.lane, boundaries(prepared.segments, namespace=namespace))
    # a rewrite goes back in the client's own form: OpenAI's APIs only (the translated form
    # of another API is not what its backend reads)
    rewritten = json.dumps(prepared.body, ensure_ascii=False).encode() \
        if prepared.changed and api.translator is None else None
    return Ask(api, view, prepared, rewritten, bool(body.get("stream")))


def usage_of(obj: Any) -> Usage | None:
    """The usage an answer (or one of its stream's events) reports, in any of the three client
    APIs' shapes: OpenAI chat and completions (`prompt_tokens`, `prompt_tokens_details.
    cached_tokens`), Responses (`input_tokens`, `input_tokens_details.cached_tokens`, also
    inside `response`), Anthropic Messages (`input_tokens` + `cache_read_input_tokens` +
    `cache_creation_input_tokens`, also inside `message`); a prefixd worker's breakdown
    (`prefixd`) rides along."""
    if not isinstance(obj, dict):
        return None
    for inner in ("response", "message"):
        if isinstance(obj.get(inner), dict) and isinstance(obj[inner].get("usage"), dict):
            obj = obj[inner]
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    worker = obj.get("prefixd", usage.get("prefixd"))
    if "prompt_tokens" in usage:
        return Usage.parse(usage, worker)
    inputs = count(usage.get("input_tokens"))
    details = usage.get("input_tokens_details")
    if isinstance(details, dict):        # Responses
        return Usage(inputs, count(usage.get("output_tokens")),
                     count(details.get("cached_tokens")),
                     worker if isinstance(worker, dict) else None)
    read_, created = (count(usage.get(k)) for k in ("cache_read_input_tokens",
                                                      "cache_creation_input_tokens"))
    if inputs is None and read_ is None:
        return None
    prompt = (inputs or 0) + (read_ or 0) + (created or 0)
    return Usage(prompt, count(usage.get("output_tokens")), read_,
                 worker if isinstance(worker, dict) else None)


class UsageScan:
    """The usage of an answer seen a chunk at a time (never held: each chunk goes on as it
    came). An event stream (SSE) is read event by event and the last usage kept, merged with
    the earlier ones' counts (Anthropic reports input tokens at the start, output at the
    end); a JSON answer is read whole, up to `MAX_SCAN` bytes."""

    def __init__(self, content_type: str) -> None:
        self.sse = content_type.startswith("text/event-stream")
        self.usage: Usage | None = None
        self._buf = bytearray()
        self._too_big = False

    def feed(self, chunk: bytes) -> None:
        if self._too_big:
            return
        self._buf += chunk
        if not self.sse:
            if len(self._buf) > MAX_SCAN:
                self._too_big, self._buf = True, bytearray()
            return
        self._buf = self._buf.replace(b"\r\n", b"\n")
        end = self._buf.rfind(b"\n\n")
        if end < 0:
            if len(self._buf) > MAX_SCAN:
                self._too_big, self._buf = True, bytearray()
            return
        events, self._buf = bytes(self._buf[:end]), self._buf[end + 2:]
        for event in events.split(b"\n\n"):
            data = b"".join(line[5:].lstrip() for line in event.split(b"\n")
                            if line.startswith(b"data:"))
            if data and data != b"[DONE]":
                self._merge(_loads(data))

    def end(self) -> Usage | None:
        if not self.sse and not self._too_big:
            self._merge(_loads(bytes(self._buf)))
        else:
            self.feed(b"\n\n")
        return self.usage

    def _merge(self, obj: Any) -> None:
        new = usage_of(obj)
        if new is None:
            return
        old = self.usage or Usage()
        self.usage = Usage(new.prompt or old.prompt, new.completion or old.completion,
                           new.cached if new.cached is not None else old.cached,
                           new.worker or old.worker)


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None
