"""Backend kind `openai`: any OpenAI-compatible upstream (llama-server, mlx_lm.server, vLLM,
Ollama). Owns its HTTP session and a periodic health probe that sets its up/down state; each
time the upstream comes up it is asked whether it is a llama-server with slots
(`backends/llama/info.py`: `slot_info()`); which slot a conversation runs in is routing's call
(`proxy/routing/slots.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp

from prefixd.backends.base import (
    BackendBase,
    BackendGone,
    BackendState,
    BackendStatus,
    UpstreamRequest,
    UpstreamResponse,
)
from prefixd.backends.config import BackendConfig, redact_url
from prefixd.backends.http import client_session, post_stream
from prefixd.backends.llama.api import LlamaAPI, NoEndpoint
from prefixd.backends.llama.info import ServerInfo, SlotState, detect_server, parse_slots
from prefixd.metrics.proxy import BACKEND_UP

log = logging.getLogger("prefixd.backend")

# /health where the server has it (llama-server, mlx_lm.server, vLLM); else /v1/models,
# which every OpenAI-compatible server answers (Ollama has no /health).
PROBE_PATHS = ("/health", "/v1/models")
WINDOW_PROBE_S = 2.0        # how long context_window() waits for a first probe


class OpenAIBackend(BackendBase):
    kind = "openai"

    def __init__(self, config: BackendConfig) -> None:
        self.name = config.name
        self.models = list(config.models)
        self._config = config
        self._base = (config.url or "").rstrip("/")
        if self._base.endswith("/v1"):
            self._base = self._base[: -len("/v1")]
        self._session: aiohttp.ClientSession | None = None
        self._probe: asyncio.Task[None] | None = None
        self._up: bool | None = None       # None until the first probe answered
        self._last_error: str | None = None
        self._last_probe: float | None = None
        self._probe_from = 0               # index into PROBE_PATHS of the path that works
        self._can_tokenize: bool | None = None   # None until /apply-template was tried
        self._tokenize_probe = asyncio.Lock()
        self._slots: ServerInfo | None = None     # set while up, if it is a llama-server
        self._generation = 0                      # times it came back after being down
        self._detecting: asyncio.Task[None] | None = None
        key = config.api_key.get_secret_value() if config.api_key else None
        self._auth = {"Authorization": f"Bearer {key}"} if key else {}

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = client_session()
        return self._session

    async def ensure_ready(self) -> None:
        # An external server is started by its owner; forward() reports it unreachable (502).
        self._ensure_session()
        if self._probe is None:
            self._probe = asyncio.create_task(self._probe_loop(), name=f"probe:{self.name}")

    @asynccontextmanager
    async def forward(self, request: UpstreamRequest) -> AsyncIterator[UpstreamResponse]:
        session = self._ensure_session()
        try:
            async with post_stream(session, self._base + request.path, request, self.name,
                                   self._auth) as resp:
                yield resp
        except BackendGone as e:  # (only ever before a response) down until a probe answers
            self._set_up(False, str(e))
            raise

    async def tokenize(self, body: dict) -> list[int] | None:
        """Exact token ids where the upstream can tell them (llama-server: /apply-template +
        /tokenize). None elsewhere; callers then estimate. A server that answers 404 to
        either endpoint is remembered as one that cannot, and not asked again."""
        if self._can_tokenize is None:        # the first calls find out, one at a time
            async with self._tokenize_probe:
                return await self._tokenize(body)
        return await self._tokenize(body)

    async def _tokenize(self, body: dict) -> list[int] | None:
        if self._can_tokenize is False:
            return None
        try:
            tokens = await self._api().tokenize(body, add_special=False)
        except NoEndpoint as e:
            if self._can_tokenize is None:
                log.info("backend %s has no %s: prefix reports use estimated token "
                         "offsets", self.name, e)
            self._can_tokenize = False
            return None
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None
        if tokens is not None:
            self._can_tokenize = True
        return tokens

    def _api(self) -> LlamaAPI:
        """llama-server's own endpoints on this upstream (tokenize, /props, /slots)."""
        return LlamaAPI(self._ensure_session(), self._base, self._auth)

    async def probe_once(self) -> bool:
        session = self._ensure_session()
        up, err = False, "health probe: no answer"
        try:
            for path in PROBE_PATHS[self._probe_from:]:
                async with session.get(self._base + path, headers=self._auth,
                                       timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 404 and path != PROBE_PATHS[-1]:
                        # no such endpoint here: use the next one (probes may overlap)
                        self._probe_from = max(self._probe_from, PROBE_PATHS.index(path) + 1)
                        continue
                    up, err = r.status < 500, f"health probe {path}: HTTP {r.status}"
                    break
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            up, err = False, f"health probe: {e or type(e).__name__}"
        came_up = up and self._up is not True
        if up and self._up is False:
            self._generation += 1             # back after being down: its cache is gone
        self._set_up(up, None if up else err)
        self._last_probe = time.time()
        if came_up:
            self._detecting = asyncio.create_task(self._detect_slots())
            await self._detecting
        return up

    def _set_up(self, up: bool, err: str | None) -> None:
        """What the last probe (or a refused connection) says: routing skips a down backend."""
        if up != self._up:
            log.log(logging.INFO if up else logging.WARNING, "backend %s is %s%s", self.name,
                    "up" if up else "down", "" if up else f" ({err})")
        self._up = up
        if err:
            self._last_error = err
        BACKEND_UP.labels(self.name).set(1 if up else 0)
        if not up:
            self._slots = None                # a restarted server has empty slots

    async def detect_slots(self) -> ServerInfo | None:
        """Wait for the slot detection of the current up period (probing once if none ran)."""
        if self._detecting is None:
            await self.probe_once()
        if self._detecting is not None:
            await asyncio.shield(self._detecting)
        return self._slots

    def slot_info(self) -> ServerInfo | None:
        return self._slots

    async def context_window(self) -> int | None:
        """The configured window, else a llama-server's per-slot `n_ctx` (its `/props`, read
        each time it comes up). Until it was seen up, this waits for the detection in
        progress, or probes once, for at most `WINDOW_PROBE_S`."""
        if self._config.context_window is not None:
            return self._config.context_window
        if self._detecting is None or not self._detecting.done():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WINDOW_PROBE_S):
                    await self.detect_slots()
        info = self._slots
        return info.n_ctx if info is not None and info.n_ctx else None

    async def fetch_slots(self) -> list[SlotState]:
        try:
            return parse_slots(await self._get_json("/slots"))
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return []

    async def _detect_slots(self) -> None:
        try:
            self._slots = await detect_server(self.name, self._get_json)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            log.debug("backend %s: no slot detection (%s)", self.name, e)

    async def _get_json(self, path: str) -> object:
        """GET `path` of the upstream: its JSON, or None when it has no such endpoint."""
        return await self._api().get_json(path)

    async def _probe_loop(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self._config.health_interval_s)

    def status(self) -> BackendStatus:
        state = {None: BackendState.UNKNOWN, True: BackendState.READY,
                 False: BackendState.DOWN}[self._up]
        return BackendStatus(name=self.name, kind=self.kind, state=state,
                             up=self._up is not False, models=self.models,
                             last_error=self._last_error, generation=self._generation,
                             detail={"url": redact_url(self._base), "last_probe": self._last_probe})

    async def stop(self) -> None:
        if self._detecting is not None and not self._detecting.done():
            self._detecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._detecting
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
            self._probe = None
        if self._session is not None:
            await self._session.close()
            self._session = None
