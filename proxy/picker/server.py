"""The picker's gRPC server: Envoy's ext_proc service (`envoy.service.ext_proc.v3.
ExternalProcessor/Process`, one stream per HTTP request: `extproc.py`) and gRPC health on the
same port, for "" (the server), `liveness`, `readiness` and the ext_proc service.

Prometheus metrics (`prefixd_picker_*` and the routing core's `prefixd_route_*`) on
`picker_metrics_port` when set.

Owns: the `Picker` (the settings, the routing core, the prefix tracker and the endpoints, one of
each for the process) and the server's lifetime: it serves until SIGTERM / SIGINT, then
stops taking streams and lets those under way end (`shutdown_timeout_s` at most).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator

import aiohttp
import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from prefixd.metrics import REGISTRY
from prefixd.proxy.picker.endpoints import Endpoints, from_backends
from prefixd.proxy.picker.extproc import Exchange
from prefixd.proxy.prefix.tracker import PrefixTracker
from prefixd.proxy.routing.core import RoutingCore
from prefixd.proxy.settings import Settings
from prefixd.proxy.stages.window import TOKENIZE_TIMEOUT_S

log = logging.getLogger("prefixd.picker")
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_NAMES = ("", "liveness", "readiness", SERVICE)


class Picker(pbg.ExternalProcessorServicer):
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.core = RoutingCore.from_settings(settings)
        self.tracker = PrefixTracker(settings)
        self.endpoints = Endpoints(from_backends(settings.backends),
                                   settings.picker_endpoints_file, settings.picker_probe_s)
        self._session: aiohttp.ClientSession | None = None
        self._no_tokenize: set[str] = set()   # endpoints that answered /tokenize with 404
        self.refresh()

    async def follow(self) -> None:
        """Follow the KV event streams of the endpoints declared now."""
        await self.core.follow.set(self.endpoints.streams())

    async def tokenize(self, model: str, body: dict, authorization: str | None = None
                       ) -> list[int] | None:
        """The prompt's token ids from an endpoint of `model` that publishes KV events
        (`POST /tokenize`: prefixd workers and vLLM answer it with `tokens`), within
        `TOKENIZE_TIMEOUT_S`; None when none can tell. Sent with the endpoint's `api_key`
        (a backend's), else the client's own `authorization` (the request goes to the same
        servers)."""
        streams = self.endpoints.streams()
        names = [n for n in self.core.index.get(model, ())
                 if n in streams and n not in self._no_tokenize and self.core.endpoints[n].up]
        if not names:
            return None
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S))
        address = self.core.endpoints[names[0]].address
        key = next((d.api_key for d in self.endpoints.declared if d.name == names[0]), None)
        headers = {"Authorization": f"Bearer {key}"} if key else \
            {"Authorization": authorization} if authorization else {}
        try:
            async with self._session.post(f"http://{address}/tokenize", headers=headers,
                                          json={**body, "model": model}) as r:
                if r.status == 404:
                    self._no_tokenize.add(names[0])
                data = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        tokens = data.get("tokens") if isinstance(data, dict) else None
        return tokens if isinstance(tokens, list) and all(
            isinstance(t, int) for t in tokens) else None

    async def close(self) -> None:
        await self.core.follow.close()
        if self._session is not None:
            await self._session.close()

    def refresh(self) -> None:
        """The core's endpoints as known now (joins, leaves, health, load)."""
        self.core.update(self.endpoints.snapshot())

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        async for response in Exchange(self).run(request_iterator):
            yield response


async def start(settings: Settings, host: str, port: int
                ) -> tuple[grpc.aio.Server, Picker, int, asyncio.Task[None]]:
    """A started picker server (its port: `port`, or the one bound for 0) and its endpoint
    prober."""
    picker = Picker(settings)
    server = grpc.aio.server()
    pbg.add_ExternalProcessorServicer_to_server(picker, server)
    status = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    for name in HEALTH_NAMES:
        await status.set(name, health_pb2.HealthCheckResponse.SERVING)
    await picker.follow()
    prober = asyncio.create_task(picker.endpoints.run(picker.follow))
    log.info("picker: ext_proc and gRPC health on %s:%d; %d endpoints", host, bound,
             len(picker.endpoints.declared))
    return server, picker, bound, prober


async def serve(settings: Settings) -> int:
    server, picker, _, prober = await start(settings, settings.host, settings.picker_port)
    if settings.picker_metrics_port is not None:
        start_http_server(settings.picker_metrics_port, settings.host, REGISTRY)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("picker: stopping")
    prober.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await prober
    await server.stop(settings.shutdown_timeout_s)
    await picker.close()
    return 0
