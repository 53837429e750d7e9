"""Backend kind `mlx`: a prefixd worker subprocess that the proxy spawns, watches, restarts
and stops.

Owns: the worker's lifecycle as a state machine — `ProcState`, one `_set_state()` that checks
`ALLOWED`, logs, sets the state/up gauges and wakes waiters — and the ONE supervisor task
that alone starts, watches, restarts and stops the child. Callers only call `ensure_ready()`,
which starts the supervisor when needed and waits for an outcome.
Invariants: at most one child per backend; every child is reaped; every wait ends at a
deadline or when the child exits; a request that could not even connect is retried once,
so none is lost to a crash it did not see.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from enum import StrEnum

import aiohttp

from prefixd.backends.base import (
    BackendError,
    BackendStatus,
    BackendUnavailable,
    UpstreamRequest,
    UpstreamResponse,
)
from prefixd.backends.http import client_session, post_stream
from prefixd.backends.process import (
    CommandBuilder,
    WorkerProcess,
    free_port,
    worker_command,
    worker_env,
)
from prefixd.metrics.proxy import BACKEND_RESTARTS, BACKEND_STATE, BACKEND_UP
from prefixd.proxy.settings import BackendConfig, Settings

log = logging.getLogger("prefixd.backend")

HEALTH_PATH = "/health"
_HEALTH_MISSES = 3      # consecutive failed probes of a running worker before it is restarted


class ProcState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"
    SHUTDOWN = "shutdown"


S = ProcState
ALLOWED: dict[ProcState, frozenset[ProcState]] = {
    S.STOPPED: frozenset({S.STARTING, S.FAILED, S.SHUTDOWN}),
    S.STARTING: frozenset({S.READY, S.STOPPING, S.STOPPED}),   # STOPPED: exited early
    S.READY: frozenset({S.STOPPING, S.STOPPED}),               # STOPPED: crashed
    S.STOPPING: frozenset({S.STOPPED, S.SHUTDOWN}),
    S.FAILED: frozenset({S.SHUTDOWN}),
    S.SHUTDOWN: frozenset(),
}


class _Idle:
    """The watch loop's verdict when the worker should be unloaded for idleness."""


class ManagedBackend:
    kind = "mlx"

    def __init__(self, config: BackendConfig, settings: Settings, *,
                 command: CommandBuilder | None = None, stop_grace_s: float = 5.0,
                 backoff_s: tuple[float, float] = (0.5, 30.0), stable_s: float = 60.0) -> None:
        """`command(port)` gives the worker argv (tests run a fake worker); `backoff_s` is the
        first and the largest restart delay; a worker ready for `stable_s` resets the count
        of consecutive failures."""
        self.name = config.name
        self.models = list(config.models)
        self._cfg, self._settings = config, settings
        self._command = command or (lambda port: worker_command(config.model or "", port))
        self._grace, self._backoff, self._stable_s = stop_grace_s, backoff_s, stable_s
        self._state = S.STOPPED
        self._changed = asyncio.Event()
        self._poke = asyncio.Event()           # wakes the supervisor's watch loop
        self._task: asyncio.Task[None] | None = None
        self._worker: WorkerProcess | None = None
        self._base: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._last_error: str | None = None
        self._start_failures = 0               # monotonic; lets waiters see a failed attempt
        self._consecutive = 0
        self._restarts = 0
        self._healthy = False
        self._suspect = False                  # a request failed: verify before handing out
        self._active = 0
        self._last_used = 0.0
        self._set_gauges()

    # --- the state machine -----------------------------------------------------------
    def _set_state(self, new: ProcState, why: str = "") -> None:
        old = self._state
        if new is old:
            return
        if new not in ALLOWED[old]:
            raise RuntimeError(f"backend {self.name}: illegal transition {old} -> {new}")
        self._state = new
        self._healthy = new is S.READY
        log.log(logging.WARNING if new is S.FAILED else logging.INFO, "backend %s: %s -> %s%s",
                self.name, old, new, f" ({why})" if why else "")
        self._set_gauges()
        self._notify()

    def _set_gauges(self) -> None:
        for s in ProcState:
            BACKEND_STATE.labels(self.name, s.value).set(1 if s is self._state else 0)
        BACKEND_UP.labels(self.name).set(1 if self._healthy else 0)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # --- the Backend face --------------------------------------------------------------
    async def ensure_ready(self) -> None:
        seen_failures = self._start_failures
        while True:
            state = self._state
            if state is S.READY and not self._suspect:
                self._last_used = self._now()
                return
            if state is S.FAILED:
                raise BackendUnavailable(f"backend {self.name!r} failed: {self._last_error}")
            if state is S.SHUTDOWN:
                raise BackendUnavailable(f"backend {self.name!r} is shut down")
            if self._start_failures != seen_failures:
                raise BackendUnavailable(
                    f"backend {self.name!r} could not start: {self._last_error}")
            if state is S.STOPPED and (self._task is None or self._task.done()):
                self._task = asyncio.create_task(self._supervise(), name=f"supervise:{self.name}")
                # Waiters must also wake when the supervisor ends (idle unload, gave up).
                self._task.add_done_callback(lambda _: self._notify())
            await self._changed.wait()

    @asynccontextmanager
    async def forward(self, request: UpstreamRequest) -> AsyncIterator[UpstreamResponse]:
        self._active += 1
        try:
            async with AsyncExitStack() as stack:
                resp = await self._open(stack, request)
                resp.chunks = self._guard(resp.chunks)
                yield resp
        finally:
            self._active -= 1
            self._last_used = self._now()
            self._poke.set()

    async def _open(self, stack: AsyncExitStack, request: UpstreamRequest) -> UpstreamResponse:
        for attempt in (1, 2):
            if self._state is not S.READY or self._base is None:
                raise BackendUnavailable(f"backend {self.name!r} is {self._state}")
            try:
                return await stack.enter_async_context(
                    post_stream(self._client(), self._base + request.path, request, self.name))
            except BackendError as e:
                self._mark_suspect()
                # Refused at connect: the worker never saw the request (it just died), so
                # sending it again after the restart cannot duplicate it.
                if attempt == 2 or not isinstance(e.__cause__, aiohttp.ClientConnectorError):
                    raise
                log.info("backend %s: connect refused; retrying after the supervisor's check",
                         self.name)
                await self.ensure_ready()
        raise AssertionError("unreachable")

    async def _guard(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except BackendError:
            self._mark_suspect()
            raise

    def _mark_suspect(self) -> None:
        if self._state is S.READY:
            self._suspect = True
            self._poke.set()

    def status(self) -> BackendStatus:
        w = self._worker
        alive = w is not None and not w.exited.is_set()
        return BackendStatus(
            name=self.name, kind=self.kind, state=self._state.value,
            up=self._state is S.READY and self._healthy, models=self.models,
            last_error=self._last_error,
            detail={"model": self._cfg.model, "pid": w.pid if alive and w else None,
                    "url": self._base if alive else None, "restarts": self._restarts,
                    "consecutive_failures": self._consecutive, "in_flight": self._active,
                    "stderr_tail": w.stderr_tail()[-5:] if w else []})

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])     # its `finally` stops the child, bounded by grace
        if self._state is not S.SHUTDOWN:
            if self._state in (S.STARTING, S.READY):   # the task never ran
                self._set_state(S.STOPPING)
            self._set_state(S.SHUTDOWN)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def wait_for(self, *states: ProcState, timeout: float) -> ProcState:
        """Return once the state is one of `states` (tests, /ready); TimeoutError otherwise."""
        async with asyncio.timeout(timeout):
            while self._state not in states:
                await self._changed.wait()
        return self._state

    # --- the supervisor: the only code that starts, watches and stops the child --------
    async def _supervise(self) -> None:
        try:
            await self._lifecycle()
        except Exception as e:   # a bug here must not leave waiters hanging
            log.exception("backend %s: supervisor error", self.name)
            self._last_error = f"supervisor error: {e!r}"
            await self._reap("supervisor error")
            self._set_state(S.FAILED, self._last_error)
        finally:
            # Cancelled by stop() (or the loop ending): the child must not outlive us.
            if self._state in (S.STARTING, S.READY):
                self._set_state(S.STOPPING, "shutting down")
            if self._worker is not None:
                await self._worker.terminate(self._grace)

    async def _lifecycle(self) -> None:
        self._consecutive = 0
        while True:
            if self._consecutive:
                delay = min(self._backoff[0] * 2 ** (self._consecutive - 1), self._backoff[1])
                log.info("backend %s: restarting in %.2fs (attempt %d)", self.name, delay,
                         self._consecutive + 1)
                await asyncio.sleep(delay)
                self._restarts += 1
                BACKEND_RESTARTS.labels(self.name).inc()
            error = await self._start()
            if error is None:
                ready_at = self._now()
                verdict = await self._watch()
                if isinstance(verdict, _Idle):
                    await self._reap(f"idle for {self._cfg.idle_unload_s:g}s")
                    return
                if self._now() - ready_at >= self._stable_s:
                    self._consecutive = 0
                self._last_error = error = verdict
                await self._reap(verdict)
            self._consecutive += 1
            if self._consecutive > self._cfg.max_restarts:
                self._last_error = f"{error} (gave up after {self._consecutive} attempts)"
                self._set_state(S.FAILED, self._last_error)
                return

    async def _start(self) -> str | None:
        """Spawn a worker and wait until it answers; None when ready, else why not."""
        port = free_port()
        self._suspect = False
        self._set_state(S.STARTING, f"port {port}")
        try:
            self._worker = await WorkerProcess.spawn(
                self._command(port), worker_env(self._cfg, self._settings), self.name,
                on_exit=self._poke.set)
        except OSError as e:
            error: str | None = f"cannot start the worker: {e}"
        else:
            self._base = f"http://127.0.0.1:{port}"
            error = await self._await_healthy(self._worker)
        if error is None:
            self._set_state(S.READY, f"pid {self._worker.pid}" if self._worker else "")
            self._last_used = self._now()
            return None
        # Set before the transition wakes the waiters, so they report this attempt.
        self._last_error = error
        self._start_failures += 1
        await self._reap(error)
        return error

    async def _await_healthy(self, worker: WorkerProcess) -> str | None:
        timeout = self._cfg.startup_timeout_s
        deadline = self._now() + timeout
        delay = 0.05
        while True:
            if worker.exited.is_set():
                return f"{worker.describe_exit()} (during start-up)"
            remaining = deadline - self._now()
            if remaining <= 0:
                tail = worker.stderr_tail()
                return (f"worker timed out after {timeout:g}s without answering {HEALTH_PATH}"
                        + (f"; last output: {tail[-1]}" if tail else ""))
            if await self._probe(min(5.0, remaining)):
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.exited.wait(), min(delay, remaining))
            delay = min(delay * 2, 0.5)

    async def _watch(self) -> str | _Idle:
        """While ready: until the child exits, stops answering, or has been idle too long."""
        worker = self._worker
        assert worker is not None
        idle_s, interval = self._cfg.idle_unload_s, self._cfg.health_interval_s
        next_probe, misses = self._now() + interval, 0
        while True:
            self._poke.clear()
            if worker.exited.is_set():
                return worker.describe_exit()
            if self._suspect:
                if await self._probe(2.0):
                    self._suspect = False
                    self._notify()
                    continue
                with contextlib.suppress(TimeoutError):   # most likely it is dying: let it
                    await asyncio.wait_for(worker.exited.wait(), 2.0)
                if worker.exited.is_set():
                    return worker.describe_exit()
                return "worker stopped answering after a failed request"
            now = self._now()
            if idle_s is not None and self._active == 0 and now >= self._last_used + idle_s:
                return _Idle()
            if now >= next_probe:
                ok = await self._probe(5.0)
                misses = 0 if ok else misses + 1
                if ok != self._healthy:
                    self._healthy = ok
                    self._set_gauges()
                if misses >= _HEALTH_MISSES:
                    return f"worker did not answer {HEALTH_PATH} {misses} times in a row"
                next_probe = self._now() + interval
                continue
            wake = next_probe
            if idle_s is not None and self._active == 0:
                wake = min(wake, self._last_used + idle_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), max(wake - now, 0.0))

    async def _reap(self, why: str) -> None:
        """Make sure the current child is gone, ending in STOPPED."""
        if self._worker is not None and not self._worker.exited.is_set():
            if self._state in (S.STARTING, S.READY):
                self._set_state(S.STOPPING, why)
            await self._worker.terminate(self._grace)
        self._set_state(S.STOPPED, why)

    async def _probe(self, timeout: float) -> bool:
        if self._base is None:
            return False
        try:
            async with self._client().get(self._base + HEALTH_PATH,
                                          timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return r.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = client_session()
        return self._session
