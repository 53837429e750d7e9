"""`prefixd picker` over its real gRPC server, driven as Envoy drives it (one ext_proc stream
per HTTP request, FULL_DUPLEX_STREAMED messages), with stand-in model servers on loopback
addresses answering the picker's probes: the pick as header and metadata, the body back byte for
byte in chunks, a conversation following the endpoint that served it, a hybrid's prefix
credited only where the endpoint can restore it, the subset hint and the selection header,
503 / 429 / 4xx in the client API's shape, canonicalization with its Content-Length, health,
endpoints joining and leaving at run time, and usage read in the three client APIs' shapes.
(The same picker behind a real Envoy: tests/test_picker_envoy.py.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from aiohttp import web  # noqa: E402
from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg  # noqa: E402
from google.protobuf import struct_pb2  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from prefixd.proxy.picker.reading import UsageScan, UsageStrip  # noqa: E402
from prefixd.proxy.picker.server import HEALTH_NAMES, Picker, start  # noqa: E402
from prefixd.proxy.settings import Settings  # noqa: E402
from tests.worker_process import free_port  # noqa: E402

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


@pytest.fixture
async def stand_ins() -> AsyncIterator[list[str]]:
    """Three model servers (ip:port) that answer /v1/models with model `m`."""
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    runners, addresses = [], []
    for host in HOSTS:
        app = web.Application()
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
        addresses.append(f"{host}:{port}")
    yield addresses
    for runner in runners:
        await runner.cleanup()


class Running:
    def __init__(self, picker: Picker, port: int) -> None:
        self.picker, self.port = picker, port
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pbg.ExternalProcessorStub(self.channel)


@pytest.fixture
async def picker_for(tmp_path: Path) -> AsyncIterator[Any]:
    started: list[tuple[Any, asyncio.Task[None], Running]] = []

    async def make(addresses: Iterable[str] = (), **settings: Any) -> Running:
        backends = [{"name": f"e{i}", "url": f"http://{a}", "models": ["m"]}
                    for i, a in enumerate(addresses)]
        s = Settings(_env_file=None, backends=backends, **settings)
        server, picker, port, prober = await start(s, "127.0.0.1", 0)
        running = Running(picker, port)
        started.append((server, prober, running))
        return running

    yield make
    for server, prober, running in started:
        prober.cancel()
        await running.channel.close()
        await server.stop(0)


def _headers(headers: dict[str, str], end: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]),
        end_of_stream=end)


class Answer:
    """What the picker sent back for one request, by kind."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.set: dict[str, str] = {}          # request headers it set
        self.metadata: dict[str, Any] = {}
        self.body_chunks: list[bytes] = []
        self.response_set: dict[str, str] = {}
        self.response_chunks: list[bytes] = []
        self.immediate: pb.ImmediateResponse | None = None

    @property
    def destination(self) -> list[str]:
        return self.set["x-gateway-destination-endpoint"].split(",")


async def exchange(running: Running, body: bytes | None, path: str = "/v1/chat/completions",
                   headers: dict[str, str] | None = None, answer: bytes | None = None,
                   content_type: str = "application/json", subset: list[str] | None = None,
                   served: str | None = None) -> Answer:
    """One request through the picker as Envoy sends it: headers, body chunks of 50,000
    bytes; then, once the pick came back, the answer's headers and `answer` in two chunks."""
    out = Answer()
    picked = asyncio.Event()
    queue: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
    meta = base_pb2.Metadata()
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        meta.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    queue.put_nowait(pb.ProcessingRequest(
        request_headers=_headers({":path": path,
                                  ":method": "GET" if body is None else "POST",
                                  "content-type": "application/json", **(headers or {})},
                                 end=body is None), metadata_context=meta))
    for i in range(0, max(1, len(body)) if body is not None else 0, 50_000):
        assert body is not None
        queue.put_nowait(pb.ProcessingRequest(request_body=pb.HttpBody(
            body=body[i:i + 50_000], end_of_stream=i + 50_000 >= len(body))))

    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        while (r := await queue.get()) is not None:
            yield r

    async def respond() -> None:
        await picked.wait()
        if out.immediate is None and answer is not None:
            queue.put_nowait(pb.ProcessingRequest(response_headers=_headers(
                {":status": "200", "content-type": content_type,
                 **({"x-gateway-destination-endpoint-served": served} if served else {})})))
            half = len(answer) // 2
            for part, end in ((answer[:half], False), (answer[half:], True)):
                queue.put_nowait(pb.ProcessingRequest(response_body=pb.HttpBody(
                    body=part, end_of_stream=end)))
        else:
            queue.put_nowait(None)

    responder = asyncio.ensure_future(respond())
    async with asyncio.timeout(30):
        async for r in running.stub.Process(requests()):
            kind = r.WhichOneof("response")
            out.kinds.append(kind)
            if kind == "request_headers":
                out.set = {h.header.key: h.header.raw_value.decode()
                           for h in r.request_headers.response.header_mutation.set_headers}
                out.metadata = json.loads(json.dumps(dict(r.dynamic_metadata)["envoy.lb"],
                                                     default=dict)) \
                    if "envoy.lb" in r.dynamic_metadata.fields else {}
                if body is None:
                    picked.set()
            elif kind == "request_body":
                streamed = r.request_body.response.body_mutation.streamed_response
                out.body_chunks.append(streamed.body)
                if streamed.end_of_stream:
                    picked.set()
            elif kind == "immediate_response":
                out.immediate = r.immediate_response
                picked.set()
                queue.put_nowait(None)
            elif kind == "response_headers":
                out.response_set = {
                    h.header.key: h.header.raw_value.decode()
                    for h in r.response_headers.response.header_mutation.set_headers}
            elif kind == "response_body":
                streamed = r.response_body.response.body_mutation.streamed_response
                out.response_chunks.append(streamed.body)
                if streamed.end_of_stream:
                    queue.put_nowait(None)
    await responder
    return out


def chat(user: str, system: str = "You are a careful coding agent. " * 20,
         history: list[dict[str, str]] | None = None, **extra: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [
        {"role": "system", "content": system}, *(history or []),
        {"role": "user", "content": user}], **extra}).encode()


def usage_answer(prompt: int, cached: int, **prefixd: Any) -> bytes:
    body: dict[str, Any] = {"object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"},
         "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": 1,
                  "prompt_tokens_details": {"cached_tokens": cached}}}
    if prefixd:
        body["usage"]["prefixd"] = prefixd
    return json.dumps(body).encode()


async def test_the_pick_is_the_header_and_the_metadata_and_the_body_comes_back_whole(
        stand_ins: list[str], picker_for: Any) -> None:
    running = await picker_for(stand_ins)
    body = chat("please read this file:\n" + "x = 1\n" * 30_000)      # ~210 KB
    got = await exchange(running, body, answer=usage_answer(40_000, 0))
    assert got.kinds[:2] == ["request_headers", "request_body"]
    assert sorted(got.destination) == sorted(stand_ins)        # the pick, then fallbacks
    assert got.metadata == {"x-gateway-destination-endpoint": ",".join(got.destination)}
    assert b"".join(got.body_chunks) == body
    assert max(map(len, got.body_chunks)) <= 62_000
    assert len(got.body_chunks) == -(-len(body) // 62_000)
    assert "content-length" not in got.set                        # not rewritten
    assert got.response_set["x-conformance-test-served-endpoint"] == got.destination[0]
    assert b"".join(got.response_chunks) == usage_answer(40_000, 0)


async def test_a_request_without_a_body_is_picked_at_once(stand_ins: list[str],
                                                          picker_for: Any) -> None:
    running = await picker_for(stand_ins)
    got = await exchange(running, None, path="/v1/models")
    assert got.kinds == ["request_headers"] and got.destination[0] in stand_ins


async def test_a_conversation_follows_the_endpoint_that_served_it(
        stand_ins: list[str], picker_for: Any) -> None:
    """Turn 1 goes where the selection header sends it (not where the picker would have sent
    it); turn 2, with no header, follows it there: what that endpoint reported taught the
    picker it holds the conversation."""
    running = await picker_for(stand_ins)
    probe = await picker_for(stand_ins)          # a second picker: where turn 1 would go
    turn1 = chat("Fix the failing test in parser.py.")
    first = (await exchange(probe, turn1)).destination[0]
    elsewhere = next(a for a in stand_ins if a != first)
    got = await exchange(running, turn1, headers={"test-epp-endpoint-selection": elsewhere},
                         answer=usage_answer(400, 0))
    assert got.destination == [elsewhere]
    turn2 = chat("Now run it again.", history=[
        {"role": "user", "content": "Fix the failing test in parser.py."},
        {"role": "assistant", "content": "ok"}])
    again = await exchange(running, turn2, answer=usage_answer(420, 400))
    assert again.destination[0] == elsewhere


async def test_a_hybrid_prefix_is_credited_only_where_the_endpoint_can_restore_it(
        stand_ins: list[str], picker_for: Any) -> None:
    """An endpoint that reports it can restore only the first 16 tokens of a 400-token prompt
    (a prefixd worker on a hybrid model, no checkpoint further in) is credited 16, not 400."""
    running = await picker_for(stand_ins)
    body = chat("Summarize the design notes.")
    got = await exchange(running, body, answer=usage_answer(
        400, 0, restorable={"positions": [16], "prefix_to": 0, "any_prefix": False}))
    name = running.picker.endpoints.by_address(got.destination[0])
    core = running.picker.core
    view = core.view("m", None, _chain(running, body))
    assert view.held[name] == (16, True)
    full = await exchange(running, body, answer=usage_answer(
        400, 16, restorable={"positions": [16, 400], "prefix_to": 0, "any_prefix": False}))
    assert full.destination[0] == got.destination[0]
    assert core.view("m", None, _chain(running, body)).held[name][0] == 400


def _chain(running: Running, body: bytes) -> Any:
    from prefixd.proxy.routing.index import boundaries

    prepared = running.picker.tracker.canonicalize(json.loads(body), {}, "")
    return boundaries(prepared.segments)


async def test_the_subset_hint_and_the_selection_header_restrict_the_candidates(
        stand_ins: list[str], picker_for: Any) -> None:
    running = await picker_for(stand_ins)
    body = chat("Which files import the router?")
    hinted = await exchange(running, body, subset=stand_ins[1:2])
    assert hinted.destination == stand_ins[1:2]
    host_only = stand_ins[2].split(":")[0]                      # an ip without its port
    chosen = await exchange(running, body, headers={"test-epp-endpoint-selection": host_only})
    assert chosen.destination == stand_ins[2:3]
    none = await exchange(running, body, subset=["10.9.9.9:1"])
    assert none.immediate is not None and none.immediate.status.code == 503
    assert json.loads(none.immediate.body)["error"]["code"] == "no_endpoint"


async def test_bad_requests_get_a_4xx_in_their_client_apis_shape(
        stand_ins: list[str], picker_for: Any) -> None:
    running = await picker_for(stand_ins)
    unknown = await exchange(running, chat("hi", model="nope"))
    assert unknown.immediate is not None and unknown.immediate.status.code == 404
    assert json.loads(unknown.immediate.body)["error"]["code"] == "model_not_found"
    broken = await exchange(running, b"{not json", path="/v1/messages")
    assert broken.immediate is not None and broken.immediate.status.code == 400
    shape = json.loads(broken.immediate.body)
    assert shape["type"] == "error" and shape["error"]["type"] == "invalid_request_error"
    big = await picker_for(stand_ins, max_body_bytes=100_000)
    too_big = await exchange(big, chat("x" * 200_000))
    assert too_big.immediate is not None and too_big.immediate.status.code == 413


async def test_every_endpoint_full_is_429(stand_ins: list[str], picker_for: Any,
                                          tmp_path: Path) -> None:
    """max_concurrency 1, queue_depth 0: while a request is under way there, the next gets
    429; once it ended, the next is picked."""
    file = tmp_path / "endpoints.json"
    file.write_text(json.dumps({"endpoints": [{"address": stand_ins[0], "models": ["m"],
                                                "max_concurrency": 1, "queue_depth": 0}]}))
    running = await picker_for(picker_endpoints_file=file)
    holding = asyncio.Event()
    release = asyncio.Event()

    async def held() -> AsyncIterator[pb.ProcessingRequest]:
        body = chat("a long answer, please")
        yield pb.ProcessingRequest(request_headers=_headers({":path": "/v1/chat/completions"}))
        yield pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
        await release.wait()

    async def first() -> None:
        async for r in running.stub.Process(held()):
            if r.WhichOneof("response") == "request_body":
                holding.set()

    task = asyncio.ensure_future(first())
    async with asyncio.timeout(30):
        await holding.wait()
    full = await exchange(running, chat("a short one"))
    assert full.immediate is not None and full.immediate.status.code == 429
    release.set()
    await task
    after = await exchange(running, chat("a short one"))
    assert after.destination == [stand_ins[0]]


async def test_a_canonicalized_body_goes_on_rewritten_with_its_length(
        stand_ins: list[str], picker_for: Any) -> None:
    running = await picker_for(stand_ins)
    system = "x-anthropic-billing-header: cc_version=2.1.37.0d9; cch=fa690;\nYou are helpful."
    got = await exchange(running, chat("hello", system=system))
    sent = b"".join(got.body_chunks)
    assert b"billing-header" not in sent and json.loads(sent)["messages"][1]["content"] == \
        "hello"
    assert got.set["content-length"] == str(len(sent))


async def test_health_answers_for_every_name(stand_ins: list[str], picker_for: Any) -> None:
    running = await picker_for(stand_ins)
    health = health_pb2_grpc.HealthStub(running.channel)
    for name in HEALTH_NAMES:
        status = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert status.status == health_pb2.HealthCheckResponse.SERVING, name
    assert set(HEALTH_NAMES) == {"", "liveness", "readiness",
                                 "envoy.service.ext_proc.v3.ExternalProcessor"}


async def test_endpoints_join_and_leave_with_the_file(stand_ins: list[str], picker_for: Any,
                                                      tmp_path: Path) -> None:
    file = tmp_path / "endpoints.json"
    file.write_text(json.dumps([{"address": stand_ins[0], "models": ["m"]}]))
    running = await picker_for(picker_endpoints_file=file, picker_probe_s=0.1)
    assert (await exchange(running, chat("q"))).destination == [stand_ins[0]]
    file.write_text(json.dumps([{"address": stand_ins[1], "models": ["m"]},
                                {"address": stand_ins[2], "models": ["m"]}]))
    async with asyncio.timeout(20):
        while True:
            got = (await exchange(running, chat("q"))).destination
            if stand_ins[0] not in got:
                break
            await asyncio.sleep(0.05)
    assert sorted(got) == sorted(stand_ins[1:])
    file.write_text("{broken")                                    # kept as they were
    await asyncio.sleep(0.3)
    assert sorted((await exchange(running, chat("q"))).destination) == sorted(stand_ins[1:])


async def test_a_down_endpoint_is_not_picked(stand_ins: list[str], picker_for: Any) -> None:
    dead = f"127.0.0.5:{free_port()}"
    running = await picker_for([dead, stand_ins[0]], picker_probe_s=0.1)
    async with asyncio.timeout(20):
        while running.picker.endpoints.up.get("e0") is not False:
            await asyncio.sleep(0.05)
    for user in ("a", "b", "c", "d"):
        assert (await exchange(running, chat(user))).destination == [stand_ins[0]]


@pytest.mark.parametrize(("content_type", "answer", "expected"), [
    ("application/json", {"usage": {"prompt_tokens": 120, "completion_tokens": 3,
                                    "prompt_tokens_details": {"cached_tokens": 100}}},
     (120, 100)),
    ("application/json", {"type": "message", "usage": {
        "input_tokens": 20, "cache_read_input_tokens": 100,
        "cache_creation_input_tokens": 0, "output_tokens": 3}}, (120, 100)),
    ("application/json", {"object": "response", "usage": {
        "input_tokens": 120, "input_tokens_details": {"cached_tokens": 100},
        "output_tokens": 3}}, (120, 100)),
])
def test_usage_is_read_in_each_client_apis_answer(content_type: str, answer: dict,
                                                  expected: tuple[int, int]) -> None:
    scan = UsageScan(content_type)
    raw = json.dumps(answer).encode()
    scan.feed(raw[:7])
    scan.feed(raw[7:])
    usage = scan.end()
    assert usage is not None and (usage.prompt, usage.cached) == expected


def test_usage_is_read_in_each_client_apis_stream() -> None:
    streams = {
        "chat": [{"choices": [{"delta": {"content": "hi"}}]},
                 {"choices": [], "usage": {"prompt_tokens": 120, "completion_tokens": 1,
                                           "prompt_tokens_details": {"cached_tokens": 100}},
                  "prefixd": {"restorable": {"positions": [64]}}}],
        "anthropic": [{"type": "message_start", "message": {"usage": {
            "input_tokens": 20, "cache_read_input_tokens": 100, "output_tokens": 1}}},
            {"type": "content_block_delta", "delta": {"text": "hi"}},
            {"type": "message_delta", "usage": {"output_tokens": 5}}],
        "responses": [{"type": "response.output_text.delta", "delta": "hi"},
                      {"type": "response.completed", "response": {"usage": {
                          "input_tokens": 120, "input_tokens_details": {"cached_tokens": 100},
                          "output_tokens": 5}}}],
    }
    for name, events in streams.items():
        raw = b"".join(b"event: x\r\ndata: " + json.dumps(e).encode() + b"\r\n\r\n"
                       for e in events) + b"data: [DONE]\n\n"
        scan = UsageScan("text/event-stream; charset=utf-8")
        for i in range(0, len(raw), 13):                 # cut anywhere, CRLF split too
            scan.feed(raw[i:i + 13])
        usage = scan.end()
        assert usage is not None and (usage.prompt, usage.cached) == (120, 100), name
    assert usage is not None


async def test_a_mutated_turn_is_reported_on_its_answer(stand_ins: list[str],
                                                        picker_for: Any) -> None:
    """The system prompt's date changed between two turns: the answer to the second carries
    prefixd's report of where and why its prefix broke, as `prefixd serve`'s does."""
    running = await picker_for(stand_ins)
    first = "You are a coding agent.\nToday's date: 2026-11-28.\n" + "Be careful. " * 40
    await exchange(running, chat("Fix the test.", system=first), answer=usage_answer(300, 0))
    second = first.replace("2026-11-28", "2026-11-29")
    got = await exchange(running, chat("Run it.", system=second, history=[
        {"role": "user", "content": "Fix the test."}, {"role": "assistant", "content": "ok"}]),
        answer=usage_answer(320, 0))
    report = dict(part.split("=", 1) for part in got.response_set["x-prefixd-prefix"].split(";"))
    assert report["verdict"] != "NEW" and "date" in report["cause"]


ANSWERS = {   # (request path, body, answer's content type, answer) in each client API's shape
    "chat": ("/v1/chat/completions", {"model": "m", "stream": True, "messages": [
        {"role": "user", "content": "Explain the scheduler."}]}, "text/event-stream",
        b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":50,"completion_tokens":1,'
        b'"prompt_tokens_details":{"cached_tokens":0}}}\n\ndata: [DONE]\n\n'),
    "anthropic": ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Explain the scheduler."}]}, "application/json",
        json.dumps({"type": "message", "content": [{"type": "text", "text": "ok"}],
                    "usage": {"input_tokens": 50, "output_tokens": 1}}).encode()),
    "responses": ("/v1/responses", {"model": "m", "input": "Explain the scheduler.",
                                    "stream": True}, "text/event-stream",
                  b'event: response.completed\ndata: {"type":"response.completed","response":'
                  b'{"usage":{"input_tokens":50,"output_tokens":1,'
                  b'"input_tokens_details":{"cached_tokens":0}}}}\n\n'),
}


@pytest.mark.parametrize("api", list(ANSWERS))
async def test_the_index_learns_from_each_client_apis_answer(
        api: str, stand_ins: list[str], picker_for: Any) -> None:
    """A complete answer records the request's prefix for the endpoint that served it (not
    for the others); an answer that failed records nothing."""
    running = await picker_for(stand_ins)
    path, body, content_type, answer = ANSWERS[api]
    prefixes, raw = running.picker.core.prefixes, json.dumps(body).encode()
    got = await exchange(running, raw, path=path, answer=answer, content_type=content_type)
    served = running.picker.endpoints.by_address(got.destination[0])
    sizes = {n: prefixes.size(n) for n in ("e0", "e1", "e2")}
    assert sizes.pop(served) > 0 and set(sizes.values()) == {0}
    fresh = await picker_for(stand_ins)
    failed = await exchange(fresh, raw, path=path, answer=None)
    assert failed.kinds[:1] == ["request_headers"]
    assert all(fresh.picker.core.prefixes.size(n) == 0 for n in ("e0", "e1", "e2"))


async def test_an_empty_body_is_answered_and_ends_the_request(stand_ins: list[str],
                                                              picker_for: Any) -> None:
    """A POST whose body is empty comes as headers then one empty chunk that ends it: that
    chunk is answered (Envoy sends the request on only once a body answer ends it); to a
    client API's path it is a 400, as from `prefixd serve`."""
    running = await picker_for(stand_ins)
    got = await exchange(running, b"", path="/v1/embeddings")
    assert got.kinds[:2] == ["request_headers", "request_body"]
    assert got.body_chunks == [b""]
    refused = await exchange(running, b"", path="/v1/chat/completions")
    assert refused.immediate is not None and refused.immediate.status.code == 400


async def test_a_stream_is_asked_for_its_usage_and_the_client_gets_none(
        stand_ins: list[str], picker_for: Any) -> None:
    """A streamed chat request that did not ask for usage: the picker asks on its behalf (the
    answer's usage, and a prefixd worker's digest, teach the index), and takes the usage out
    of the answer again, event by event, however the bytes are cut; a stream that asked keeps
    it, its body untouched."""
    running = await picker_for(stand_ins)
    answer = (b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
              b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
              b'"usage":{"prompt_tokens":300,"completion_tokens":1,'
              b'"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
              b': a comment\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":300,"completion_tokens":1,'
              b'"prompt_tokens_details":{"cached_tokens":0}},"prefixd":{"restorable":'
              b'{"positions":[64],"prefix_to":0,"any_prefix":false}}}\n\n'
              b'data: [DONE]\n\n')
    body = chat("Stream this, please.", stream=True)
    got = await exchange(running, body, answer=answer, content_type="text/event-stream")
    sent = json.loads(b"".join(got.body_chunks))
    assert sent["stream_options"] == {"include_usage": True}
    assert got.set["content-length"] == str(len(b"".join(got.body_chunks)))
    client = b"".join(got.response_chunks)
    assert b"usage" not in client and b"prefixd" not in client
    assert client == (b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
                      b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
                      b': a comment\n\ndata: [DONE]\n\n')
    name = running.picker.endpoints.by_address(got.destination[0])
    held = running.picker.core.view("m", None, _chain(running, body)).held
    assert held[name] == (64, True)                    # the digest taught the index
    asked = chat("Stream this too.", stream=True, stream_options={"include_usage": True})
    kept = await exchange(running, asked, answer=answer, content_type="text/event-stream")
    assert b"".join(kept.body_chunks) == asked and "content-length" not in kept.set
    assert b"".join(kept.response_chunks) == answer
    for size in (1, 7, 64):                            # cut anywhere, CRLF line ends too
        for raw in (answer, answer.replace(b"\n", b"\r\n")):
            strip = UsageStrip()
            parts = [raw[i:i + size] for i in range(0, len(raw), size)]
            out = b"".join(strip.feed(p, end=i == len(parts) - 1)
                           for i, p in enumerate(parts))
            assert b"usage" not in out and out.count(b"data: ") == 3, (size, raw[:20])


def test_backends_are_named_by_ip_and_port() -> None:
    from prefixd.backends.config import BackendConfig
    from prefixd.proxy.picker.endpoints import from_backends

    got = from_backends([BackendConfig(name="a", url="http://localhost:8000/v1", models=["m"]),
                         BackendConfig(name="b", url="https://10.0.0.7/v1", models=["m"]),
                         BackendConfig(name="c", url="http://[::1]:9000", models=["m"]),
                         BackendConfig(name="d", kind="mlx", model="x")])
    assert [(d.name, d.address) for d in got] == [
        ("a", "127.0.0.1:8000"), ("b", "10.0.0.7:443"), ("c", "[::1]:9000")]


def test_an_endpoint_at_another_address_is_another_server() -> None:
    from prefixd.proxy.routing.core import Endpoint, Reported, RoutingCore
    from prefixd.proxy.routing.index import Boundary, Chain
    from prefixd.proxy.routing.policy import Balance

    core = RoutingCore(Balance())
    core.update([Endpoint("a", ("m",), address="10.0.0.1:80")])
    chain = Chain([Boundary("k1", 100), Boundary("k2", 200)], 2)
    core.outcome(core.view("m", None, chain), core.ranked(core.view("m", None, chain))[0],
                 Reported(prompt=200))
    assert core.view("m", None, chain).held["a"][0] == 200
    core.update([Endpoint("a", ("m",), address="10.0.0.1:80", load=3)])    # only busier
    assert core.view("m", None, chain).held["a"][0] == 200
    core.update([Endpoint("a", ("m",), address="10.0.0.2:80")])            # moved
    assert core.view("m", None, chain).held.get("a", (0, False))[0] == 0
