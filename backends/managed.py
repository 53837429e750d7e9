"""Backend kind `mlx`: a prefixd worker subprocess that the proxy spawns, watches, restarts
and stops — the Backend face of it.

Owns: `ensure_ready()` (start the worker if needed, wait for an outcome), `forward()` over
HTTP to the worker, `status()` and `stop()`. The lifecycle itself (states, the supervisor
task) lives in `supervision/supervisor.py`, the child process in
`supervision/process.py`.
Invariants: a request is handed to the worker only in state `ready` and after any failed
request was checked, with the current worker's token; a request that failed before any
response byte because the worker was gone (refused at connect, or the connection dropped
or reset as the worker died) is sent again once after the restart — none is lost, and none
is sent again once the worker has answered anything. A `failed` backend asked for a
request tries one new start if its last attempt is old enough (`retry_min_s`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp

from prefixd.backends import worker_api
from prefixd.backends.base import (
    BackendBase,
    BackendError,
    BackendState,
    BackendStatus,
    BackendTimeout,
    BackendUnavailable,
    Capabilities,
    Managed,
    UpstreamRequest,
    UpstreamResponse,
    WorkerLink,
)
from prefixd.backends.config import BackendConfig
from prefixd.backends.http import dropped, post_stream
from prefixd.backends.mlx.settings import WorkerSettings
from prefixd.backends.supervision.health import local_session
from prefixd.backends.supervision.process import EXIT_LOAD_FAILED, CommandBuilder, worker_command
from prefixd.backends.supervision.states import ProcState
from prefixd.backends.supervision.supervisor import EnvBuilder, Supervisor

log = logging.getLogger("prefixd.backend")

class ManagedBackend(BackendBase):
    kind = "mlx"
    capabilities = Capabilities(moves_state=True, restarts_itself=True, partitions_cache=True)

    def __init__(self, config: BackendConfig, settings: WorkerSettings, *,
                 command: CommandBuilder | None = None, stop_grace_s: float = 20.0,
                 backoff_s: tuple[float, float] = (0.5, 30.0), stable_s: float = 60.0,
                 retry_min_s: float = 5.0, env: EnvBuilder | None = None,
                 load_failed_exit: int | None = EXIT_LOAD_FAILED) -> None:
        """`command(port)` gives the worker argv (tests run a fake worker); `stop_grace_s`
        is the SIGTERM→SIGKILL grace; `backoff_s` the first and the largest restart delay;
        a worker ready for `stable_s` resets the backoff; a request makes a failed backend
        try again at most once per `retry_min_s`; `env` and `load_failed_exit`: another
        kind of child (`Supervisor`)."""
        self.name = config.name
        if len(config.hosts) > 1:   # a group worker moves no prefix states (yet)
            self.capabilities = Capabilities(restarts_itself=True, partitions_cache=True)
        self.models = list(config.models)
        self.config = config
        self.model_spec = config.model
        self.cache_budget = config.cache_bytes
        self.extra_bytes = 0
        self._model = config.model
        command = command or (lambda port: worker_command(
            config.model or "", port, config.models[0] if config.models else None))
        self._stop_grace_s = stop_grace_s
        self._sup = Supervisor(config, settings, command, grace_s=stop_grace_s,
                               backoff_s=backoff_s, stable_s=stable_s, retry_min_s=retry_min_s,
                               env=env, load_failed_exit=load_failed_exit)
        self._session: aiohttp.ClientSession | None = None
        self._stopper: asyncio.Future[None] | None = None
        self._window = worker_api.WindowMemo()
        self._cache_dir = settings.cache_dir
        self._peeked: tuple[int | None] | None = None   # the window its model's config says

    async def settle(self) -> None:
        """Return once a worker being stopped has exited: whether it starts again is then
        the model pool's call, not a side effect of a request arriving mid-stop."""
        if self._sup.state is ProcState.STOPPING:
            await self.wait_for(ProcState.STOPPED, ProcState.FAILED, ProcState.SHUTDOWN,
                                timeout=self._stop_grace_s + 30.0)

    def join_pool(self, may_start: Callable[[], bool]) -> None:
        """A model pool decides when this backend loads: a scheduled retry after a failure
        starts the worker only when `may_start()` (it fits beside what is loaded now)."""
        self._sup.may_start = may_start

    async def ensure_ready(self) -> None:
        sup = self._sup
        seen_failures = sup.start_failures
        while True:
            if self._stopper is not None or sup.state is ProcState.SHUTDOWN:
                raise BackendUnavailable(f"backend {self.name!r} is shut down")
            if sup.state is ProcState.READY and not sup.suspect:
                sup.touch()
                return
            if sup.start_failures != seen_failures:
                raise BackendUnavailable(
                    f"backend {self.name!r} could not start: {sup.last_error}")
            if sup.state is ProcState.FAILED:
                if not sup.request_retry():
                    wait = sup.retry_in()
                    raise BackendUnavailable(
                        f"backend {self.name!r} failed: {sup.last_error}"
                        + (f" (next attempt in {wait:.0f}s)" if wait is not None else ""))
            else:
                sup.start()
            await sup.changed.wait()

    @asynccontextmanager
    async def forward(self, request: UpstreamRequest) -> AsyncIterator[UpstreamResponse]:
        self._sup.request_started()
        try:
            async with AsyncExitStack() as stack:
                resp = await self._open(stack, request)
                resp.chunks = self._guard(resp.chunks)
                yield resp
        finally:
            self._sup.request_ended()

    async def _open(self, stack: AsyncExitStack, request: UpstreamRequest) -> UpstreamResponse:
        sup = self._sup
        for attempt in (1, 2):
            if sup.state is not ProcState.READY or sup.base_url is None:
                raise BackendUnavailable(f"backend {self.name!r} is {sup.state}")
            if self._session is None:
                self._session = local_session()
            try:
                return await stack.enter_async_context(post_stream(
                    self._session, sup.base_url + request.path, request, self.name, sup.auth))
            except BackendError as e:
                sup.report_failure()
                # Refused at connect, or dropped before any response byte: the worker was
                # (being) killed with the request unanswered; its successor gets it once.
                cause = e.__cause__
                if attempt == 2 or isinstance(e, BackendTimeout) or not (
                        isinstance(cause, aiohttp.ClientConnectorError) or dropped(cause)):
                    raise
                log.info("backend %s: the worker was gone before answering (%s); sending "
                         "again once it is ready", self.name, e)
                await self.ensure_ready()
        raise AssertionError("unreachable")

    async def _guard(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except BackendError:
            self._sup.report_failure()
            raise

    def worker(self) -> WorkerLink | None:
        base = self._sup.base_url
        if self._sup.state is not ProcState.READY or base is None:
            return None
        if self._session is None:
            self._session = local_session()
        return WorkerLink(self._session, base, self._sup.auth)

    async def tokenize(self, body: dict) -> list[int] | None:
        return await worker_api.tokenize(self.worker(), body)

    async def metrics_text(self) -> str | None:
        return await worker_api.metrics_text(self.worker())

    async def cache_info(self) -> dict | None:
        return await worker_api.cache_info(self.worker())

    async def context_window(self) -> int | None:
        """The configured window, else the worker's (its model's config), asked once per
        worker; the last one learned while no worker runs; before the first load, what the
        model's config says (read once, nothing loaded), so a client knows the window while
        the weights load."""
        if self.config.context_window is not None:
            return self.config.context_window
        window = await self._window.get(self.worker(), self._sup.restarts)
        if window is not None:
            return window
        if self._peeked is None:
            from prefixd.backends.mlx.model.provision import config_window

            spec = self.config.model
            self._peeked = (None if spec is None else
                            await asyncio.to_thread(config_window, spec, self._cache_dir),)
        return self._peeked[0]

    def managed(self) -> Managed:
        return self

    @property
    def loaded(self) -> bool:
        """A worker is running, starting, or about to be restarted after a crash (it holds,
        or is about to hold, memory)."""
        return (self._sup.state in (ProcState.STARTING, ProcState.READY, ProcState.STOPPING)
                or self._sup.restarting)

    @property
    def ready(self) -> bool:
        return self._sup.state is ProcState.READY

    @property
    def busy(self) -> bool:
        return self._sup.active > 0

    def set_cache_bytes(self, n: int) -> None:
        """The prompt-cache budget its next workers get (the model pool's share, for a
        backend configured without one)."""
        self.cache_budget = n
        self._sup.cache_bytes = n

    async def unload(self, why: str, reason: str, timeout: float = 60.0) -> None:
        """Stop the worker to free its memory; it starts again on the next request.
        `reason` (budget, group) labels `prefixd_model_unloads_total`."""
        sup = self._sup
        if sup.state in (ProcState.READY, ProcState.STARTING) or sup.restarting:
            sup.request_unload(why, reason)
            async with asyncio.timeout(timeout):
                while self.loaded:
                    await sup.changed.wait()

    def status(self) -> BackendStatus:
        """The worker's pid and URL are shown (operators need them), never its token."""
        sup, w = self._sup, self._sup.worker
        alive = w is not None and not w.exited.is_set()
        retry_in = sup.retry_in()                 # a failed backend's next attempt
        return BackendStatus(
            name=self.name, kind=self.kind, state=BackendState(sup.state.value),
            up=sup.state is ProcState.READY and sup.healthy, models=self.models,
            last_error=sup.last_error, generation=sup.restarts,
            detail={"model": self._model, "pid": w.pid if w is not None and alive else None,
                    "url": sup.base_url if alive else None, "restarts": sup.restarts,
                    "consecutive_failures": sup.consecutive,
                    "retry_at": None if retry_in is None else round(time.time() + retry_in, 3),
                    "retry_in_s": None if retry_in is None else round(retry_in, 1),
                    "stderr_tail": w.stderr_tail()[-5:] if w is not None else []})

    async def stop(self) -> None:
        # One shutdown however many callers; a caller cancelled midway does not cut it short.
        if self._stopper is None:
            self._stopper = asyncio.ensure_future(self._shutdown())
        await asyncio.shield(self._stopper)

    async def _shutdown(self) -> None:
        await self._sup.shutdown()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def wait_for(self, *states: ProcState, timeout: float) -> ProcState:
        """Return once the state is one of `states` (tests, tools); TimeoutError otherwise."""
        async with asyncio.timeout(timeout):
            while self._sup.state not in states:
                await self._sup.changed.wait()
        return self._sup.state
