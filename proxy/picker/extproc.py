"""One Envoy ext_proc stream: one HTTP request through the gateway, in FULL_DUPLEX_STREAMED
mode both ways (the Gateway API Inference Extension's endpoint-picker protocol).

Owns: the request's headers and body until the body has ended, the pick, and its answer's
scan. The flow:
1. request headers: held (a request without a body is picked at once);
2. request body chunks: kept (at most `max_body_bytes`: past it, 413); at its end the pick is
   sent as the answer to the headers: header `x-gateway-destination-endpoint: ip:port[,...]`
   (the first the pick, the rest ordered fallbacks) and the same value in the `envoy.lb`
   dynamic metadata; then the body, echoed (or rewritten by canonicalization, with its
   `Content-Length` set) in chunks of at most `CHUNK` bytes;
3. response headers: answered with `x-conformance-test-served-endpoint` (the endpoint that
   served it, as the data plane reports it in `x-gateway-destination-endpoint-served`, else
   the pick) and prefixd's mutation report (`X-Prefixd-Prefix`) where there is one;
4. response body chunks: each echoed as it arrives (an event stream is never held) and
   scanned for the usage the answer reports; at its end the routing core learns from it.
A request nothing can serve gets an immediate response in its client API's error shape: 503
when no endpoint is eligible, 429 when every eligible one is full (shedding load).

The candidates: the request's model's endpoints that are up, within the data plane's subset
hint (`envoy.lb.subset_hint`) and, for tests, the request header
`test-epp-endpoint-selection: ip[:port][,...]`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from prefixd.api.errors import ApiError, error_body, status_type
from prefixd.metrics import picker as m
from prefixd.proxy.keys import cache_namespace
from prefixd.proxy.picker.reading import Ask, UsageScan, UsageStrip, api_for, read
from prefixd.proxy.prefix.report import header
from prefixd.proxy.routing.core import Reported
from prefixd.proxy.routing.policy import Decision

if TYPE_CHECKING:
    from prefixd.proxy.picker.server import Picker

CHUNK = 62_000                 # bytes of a body chunk sent back to Envoy, at most
DESTINATION = "x-gateway-destination-endpoint"
SUBSET = ("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset")
SELECTION = "test-epp-endpoint-selection"
SERVED = "x-gateway-destination-endpoint-served"
SERVED_TEST = "x-conformance-test-served-endpoint"


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    return {h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
            for h in message.headers.headers}


def _set(headers: dict[str, str]) -> pb.HeaderMutation:
    return pb.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()))
        for k, v in headers.items()])


def _body(data: bytes, end: bool) -> pb.BodyResponse:
    return pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(
        streamed_response=pb.StreamedBodyResponse(body=data, end_of_stream=end))))


def _chunks(data: bytes, end: bool, kind: str) -> list[pb.ProcessingResponse]:
    """`data` as body responses of at most `CHUNK` bytes (one, empty, when it is)."""
    parts = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
    return [pb.ProcessingResponse(**{kind: _body(p, end and i == len(parts) - 1)})
            for i, p in enumerate(parts)]


def _subset(request: pb.ProcessingRequest) -> set[str] | None:
    """The data plane's subset hint (ip:port strings), None when it gave none."""
    ns = request.metadata_context.filter_metadata.get(SUBSET[0])
    if ns is None or SUBSET[1] not in ns.fields:
        return None
    value = ns.fields[SUBSET[1]]
    if value.HasField("list_value"):
        items = [v.string_value for v in value.list_value.values]
    else:
        items = value.string_value.split(",")
    return {i.strip() for i in items if i.strip()}


def _selected(header: str | None, addresses: dict[str, str]) -> set[str] | None:
    """The endpoints a `test-epp-endpoint-selection` header names (ip or ip:port)."""
    if header is None:
        return None
    wanted = {w.strip() for w in header.split(",") if w.strip()}
    return {n for n, a in addresses.items() if a in wanted or a.rsplit(":", 1)[0] in wanted}


class Exchange:
    """One request's stream (see the module docstring)."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.ask: Ask | None = None
        self.subset: set[str] | None = None
        self.picked: str | None = None       # the endpoint counted in flight
        self.decisions: dict[str, Decision] = {}   # the order sent, by endpoint
        self.served: str | None = None
        self.scan: UsageScan | None = None
        self.strip: UsageStrip | None = None
        self.too_big = False
        self.has_body = False       # Envoy sent body messages (an empty one ends a bodiless POST)
        self.detected = False

    async def run(self, requests: AsyncIterator[pb.ProcessingRequest]
                  ) -> AsyncIterator[pb.ProcessingResponse]:
        try:
            async for r in requests:
                for out in await self.handle(r):
                    yield out
                self.detect()
        finally:
            self.done()

    async def handle(self, r: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = r.WhichOneof("request")
        if kind == "request_headers":
            self.headers = _headers(r.request_headers)
            self.subset = _subset(r)
            return await self.pick() if r.request_headers.end_of_stream else []
        if kind == "request_body":
            self.has_body = True
            if not self.too_big:
                self.body += r.request_body.body
                self.too_big = len(self.body) > self.picker.settings.max_body_bytes
            return await self.pick() if r.request_body.end_of_stream else []
        if kind == "request_trailers":
            out = await self.pick() if self.picked is None and self.ask is None else []
            return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            return [self.respond(_headers(r.response_headers),
                                 r.response_headers.end_of_stream)]
        if kind == "response_body":
            chunk, end = r.response_body.body, r.response_body.end_of_stream
            if self.scan is not None:
                self.scan.feed(chunk)
            if end:
                self.learn()
            sent = chunk if self.strip is None else self.strip.feed(chunk, end)
            return [pb.ProcessingResponse(response_body=_body(sent, end))]
        if kind == "response_trailers":
            self.learn()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    # --- the request ------------------------------------------------------------------------
    async def pick(self) -> list[pb.ProcessingResponse]:
        t0 = time.perf_counter()
        p = self.picker
        p.refresh()       # models an endpoint's probe found, health, load: before the read
        path = self.headers.get(":path", "/")
        try:
            if self.too_big:
                raise ApiError(413, f"request body is larger than {p.settings.max_body_bytes} "
                               "bytes (max_body_bytes)", code="request_too_large")
            namespace = cache_namespace(self.headers, p.settings.cache_isolation)
            self.ask = ask = read(path, bytes(self.body), self.headers, p.core, p.tracker,
                                  namespace) if self.has_body else Ask(api_for(path))
            if ask.view is not None and ask.prepared is not None and not namespace \
                    and p.core.wants_tokens(ask.view.model):   # what endpoints announce
                v = ask.view
                ask.view = p.core.view(v.model, v.lane, v.chain,
                                       await p.tokenize(v.model, ask.prepared.body,
                                                        self.headers.get("authorization")))
            order = self.order(ask)
        except ApiError as e:
            m.PICKS.labels(str(e.status)).inc()
            return [self.refuse(e)]
        self.picked = order[0]
        p.endpoints.inflight[self.picked] += 1
        m.IN_FLIGHT.labels(self.picked).set(p.endpoints.inflight[self.picked])
        value = ",".join(p.core.endpoints[n].address for n in order)
        set_headers = {DESTINATION: value}
        body = bytes(self.body) if ask.body is None else ask.body
        if ask.body is not None:
            set_headers["content-length"] = str(len(body))
        meta = struct_pb2.Struct()
        meta.update({"envoy.lb": {DESTINATION: value}})
        out = [pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                clear_route_cache=True, header_mutation=_set(set_headers))),
            dynamic_metadata=meta)]
        if self.has_body:                # every body message Envoy sent is answered
            out += _chunks(body, True, "request_body")
        self.body = bytearray()          # sent on: not held for the answer's time
        m.PICKS.labels("picked").inc()
        m.PICK_SECONDS.observe(time.perf_counter() - t0)
        return out

    def order(self, ask: Ask) -> list[str]:
        """The endpoints to try, the pick first (ApiError 503 / 429: none / all full)."""
        p = self.picker
        addresses = {n: e.address for n, e in p.core.endpoints.items()}
        among = {n for n, a in addresses.items() if self.subset is None or a in self.subset}
        chosen = _selected(self.headers.get(SELECTION), addresses)
        if chosen is not None:
            among &= chosen
        among = {n for n in among if p.core.endpoints[n].up}
        if ask.view is None:          # a path not read: any endpoint, the least loaded first
            names = sorted(among, key=lambda n: (p.endpoints.inflight[n], n))
        else:
            self.decisions = {d.name: d for d in p.core.ranked(ask.view, among=among)}
            names = list(self.decisions)
        if not names:
            raise ApiError(503, "no endpoint is eligible for this request (its model's "
                           "endpoints are down or outside the gateway's subset)",
                           code="no_endpoint", type_="service_unavailable")
        room = [n for n in names if p.endpoints.inflight[n] < p.endpoints.limit(n)]
        if not room:
            raise ApiError(429, "every endpoint of this model is full: retry later",
                           code="overloaded", type_="rate_limit_error")
        return [n for n in names if n in room] + [n for n in names if n not in room]

    def detect(self) -> None:
        """The request's mutation report, once its pick went out (not on its way)."""
        ask = self.ask
        if ask is not None and ask.prepared is not None and not self.detected \
                and self.picked is not None and self.picker.settings.prefix_detect:
            self.detected = True
            self.picker.tracker.detect(ask.prepared)

    def refuse(self, e: ApiError) -> pb.ProcessingResponse:
        api = self.ask.api if self.ask is not None else api_for(self.headers.get(":path", "/"))
        body = api.error_body(e) if api is not None else \
            error_body(e.message, e.type_ or status_type(e.status), param=e.param, code=e.code)
        return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=e.status),
            headers=_set({"content-type": "application/json"}),
            body=json.dumps(body).encode(), details=e.message))

    # --- the answer -------------------------------------------------------------------------
    def respond(self, headers: dict[str, str], end: bool) -> pb.ProcessingResponse:
        p = self.picker
        served = headers.get(SERVED, "").split(",")[0].strip()
        self.served = p.endpoints.by_address(served) or self.picked
        ok = headers.get(":status", "200").startswith("2")
        content_type = headers.get("content-type", "")
        self.scan = UsageScan(content_type) if ok else None
        if self.ask is not None and self.ask.strip_usage and \
                content_type.startswith("text/event-stream"):
            self.strip = UsageStrip()
        add = {}
        if self.served is not None:
            add[SERVED_TEST] = p.core.endpoints[self.served].address \
                if self.served in p.core.endpoints else served
        report = self.ask.prepared.report if self.ask and self.ask.prepared else None
        if report is not None:
            add["x-prefixd-prefix"] = header(report)
        if end:
            self.learn()
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=_set(add))))

    def learn(self) -> None:
        """The answer ended: what it reported feeds the routing core and the lane."""
        ask, scan, served = self.ask, self.scan, self.served
        self.scan = None
        if ask is None or ask.view is None or scan is None or served is None:
            return
        usage = scan.end()
        m.LEARNED.labels("reported" if usage is not None else "none").inc()
        p = self.picker
        decision = self.decisions.get(served, Decision(served, "fallback", 0))
        reported = Reported(usage.prompt, usage.cached, usage.worker) if usage else None
        p.core.outcome(ask.view, decision, reported)
        if ask.prepared is not None:
            p.tracker.record_response(ask.prepared, None, usage)

    def done(self) -> None:
        if self.picked is not None:
            inflight = self.picker.endpoints.inflight
            inflight[self.picked] -= 1
            m.IN_FLIGHT.labels(self.picked).set(inflight[self.picked])
            self.picked = None
        if self.ask is not None and self.ask.prepared is not None and \
                not self.ask.prepared.served:
            self.picker.tracker.unserved(self.ask.prepared)

