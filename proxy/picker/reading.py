"""A request as the picker reads it, and what its answer teaches: the same parsing as
`prefixd serve`'s (the client API's translator, the shared schema, lanes, mutation reports,
canonicalization where enabled), and the usage each client API reports in its answer.

Owns nothing between calls but what one request carries (`Ask`) and one answer's scan
(`UsageScan`).
"""

from __future__ import annotations

import json
import re
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
from prefixd.proxy.sse import loads

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
    strip_usage: bool = False   # a stream asked for usage on its behalf (`UsageStrip`)


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
    chat = body if api.translator is None else api.translator.chat_request(body)
    req = validate(api.kind, chat)
    model = core.model_for(req.model)
    prepared = tracker.canonicalize(chat, headers, namespace)
    view = core.view(model, prepared.lane, boundaries(prepared.segments, namespace=namespace))
    if api.translator is not None:   # a rewrite goes back in the client's own form: OpenAI's
        return Ask(api, view, prepared)  # APIs only (the translated form is not what it sent)
    out, strip = prepared.body, False
    options = out.get("stream_options")
    if out.get("stream") is True and not (isinstance(options, dict)
                                          and options.get("include_usage") is True):
        # a stream reports its usage (and a prefixd worker what it can restore) only when
        # asked: asked here, and taken out of the answer again (`UsageStrip`), as `prefixd
        # serve` does
        out = {**out, "stream_options": {**(options if isinstance(options, dict) else {}),
                                         "include_usage": True}}
        strip = True
    rewritten = json.dumps(out, ensure_ascii=False).encode() \
        if prepared.changed or strip else None
    return Ask(api, view, prepared, rewritten, strip)


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


class UsageStrip:
    """An OpenAI event stream without the usage the picker asked for on the client's behalf:
    a usage-only event is dropped, a usage beside choices removed; every other byte passes as
    it came, each event as soon as it is whole (a partial event waits for its end, nothing
    else). An event past `MAX_SCAN` bytes ends the stripping: the rest passes untouched."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.off = False

    def feed(self, chunk: bytes, end: bool = False) -> bytes:
        if self.off:
            return chunk
        self._buf += chunk
        cut = max(self._buf.rfind(b"\n\n"), self._buf.rfind(b"\r\n\r\n"))
        if end:
            cut = len(self._buf)
        elif cut < 0:
            if len(self._buf) > MAX_SCAN:
                self.off, out = True, bytes(self._buf)
                self._buf.clear()
                return out
            return b""
        else:
            cut += 4 if self._buf[cut:cut + 4] == b"\r\n\r\n" else 2
        ready = bytes(self._buf[:cut])
        del self._buf[:cut]
        return b"".join(_without_usage(e) for e in re.split(rb"(?<=\n\n)|(?<=\r\n\r\n)", ready))


def _without_usage(event: bytes) -> bytes:
    lines = event.splitlines(keepends=True)
    data = [i for i, line in enumerate(lines) if line.startswith(b"data:")]
    if len(data) != 1:
        return event
    obj = loads(lines[data[0]][5:].strip())
    if not isinstance(obj, dict) or "usage" not in obj:
        return event
    if not obj.get("choices"):
        return b""                       # the usage chunk the client did not ask for
    del obj["usage"]
    obj.pop("prefixd", None)
    ending = b"\r\n" if lines[data[0]].endswith(b"\r\n") else b"\n"
    lines[data[0]] = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + ending
    return b"".join(lines)


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
                self._merge(loads(data))

    def end(self) -> Usage | None:
        if not self.sse and not self._too_big:
            self._merge(loads(bytes(self._buf)))
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
