"""The lifecycle of one managed worker: a state machine and the ONE task that drives it.

Owns: `ProcState`, the `ALLOWED` transitions, `_set_state()` (checks the table, logs, sets
the state/up gauges, wakes waiters) and the supervisor task that alone starts the child,
waits for its /health with a deadline, health-checks it, restarts it with capped
exponential backoff, gives up (`failed`) after `max_restarts` consecutive failures,
unloads it when idle, and stops it. Every wait ends at a deadline or when the child exits.
The Backend face (`managed`) only reads the state and reports requests and failures.
"""

from __future__ import annotations

import asyncio
import logging
from enum import StrEnum

import aiohttp

from prefixd.backends.config import BackendConfig
from prefixd.backends.mlx.settings import WorkerSettings
from prefixd.backends.process import (
    CommandBuilder,
    WorkerProcess,
    free_port,
    wait_event,
    worker_env,
)
from prefixd.metrics.proxy import BACKEND_RESTARTS, BACKEND_STATE, BACKEND_UP

log = logging.getLogger("prefixd.backend")

HEALTH_PATH = "/health"
HEALTH_MISSES = 3       # consecutive failed probes of a running worker before it is restarted


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


def local_session() -> aiohttp.ClientSession:
    """A session to a local worker, without keep-alive: a reused connection to a worker that
    just died fails as "server disconnected", which looks like a worker that died holding
    the request; a fresh connection (cheap on loopback) fails as "refused", safe to retry."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=None))


class _Idle:
    """The watch loop's verdict when the worker should be unloaded for idleness."""


class Supervisor:
    def __init__(self, config: BackendConfig, settings: WorkerSettings, command: CommandBuilder, *,
                 grace_s: float, backoff_s: tuple[float, float], stable_s: float) -> None:
        self.name = config.name
        self._cfg, self._settings, self._command = config, settings, command
        self._grace, self._backoff, self._stable_s = grace_s, backoff_s, stable_s
        self.state = S.STOPPED
        self.changed = asyncio.Event()         # replaced on every change: wait on the current
        self._poke = asyncio.Event()           # wakes the watch loop
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self.worker: WorkerProcess | None = None
        self.base_url: str | None = None
        self.last_error: str | None = None
        self.start_failures = 0                # monotonic: lets waiters see a failed attempt
        self.consecutive = 0
        self.restarts = 0
        self.healthy = False
        self.suspect = False                   # a request failed: verify before handing out
        self.active = 0
        self._last_used = 0.0
        self._set_gauges()

    # --- the state machine -----------------------------------------------------------
    def _set_state(self, new: ProcState, why: str = "") -> None:
        old = self.state
        if new is old:
            return
        if new not in ALLOWED[old]:
            raise RuntimeError(f"backend {self.name}: illegal transition {old} -> {new}")
        self.state = new
        self.healthy = new is S.READY
        log.log(logging.WARNING if new is S.FAILED else logging.INFO, "backend %s: %s -> %s%s",
                self.name, old, new, f" ({why})" if why else "")
        self._set_gauges()
        self._notify()

    def _set_gauges(self) -> None:
        for s in ProcState:
            BACKEND_STATE.labels(self.name, s.value).set(1 if s is self.state else 0)
        BACKEND_UP.labels(self.name).set(1 if self.healthy else 0)

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # --- what the Backend face calls ----------------------------------------------------
    def start(self) -> None:
        """Run the supervisor task if the worker is stopped and nothing runs it."""
        if self.state is S.STOPPED and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._supervise(), name=f"supervise:{self.name}")
            # Waiters must also wake when the task ends (idle unload, gave up).
            self._task.add_done_callback(lambda _: self._notify())

    def request_started(self) -> None:
        self.active += 1
        self._last_used = self._now()

    def request_ended(self) -> None:
        self.active -= 1
        self._last_used = self._now()
        self._poke.set()        # the idle clock restarts now

    def touch(self) -> None:
        self._last_used = self._now()

    def report_failure(self) -> None:
        """A request to the worker failed: have it checked before the next one is sent."""
        if self.state is S.READY:
            self.suspect = True
            self._poke.set()

    async def shutdown(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])     # its `finally` stops the child, bounded by grace
        if self.state in (S.STARTING, S.READY):   # a task cancelled before it ever ran
            self._set_state(S.STOPPING)
        self._set_state(S.SHUTDOWN)
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- the task: the only code that starts, watches and stops the child ---------------
    async def _supervise(self) -> None:
        try:
            await self._lifecycle()
        except Exception as e:   # a bug here must not leave waiters hanging
            log.exception("backend %s: supervisor error", self.name)
            self.last_error = f"supervisor error: {e!r}"
            await self._reap("supervisor error")
            self._set_state(S.FAILED, self.last_error)
        finally:
            # Cancelled by stop() (or the loop ending): the child must not outlive us.
            if self.state in (S.STARTING, S.READY):
                self._set_state(S.STOPPING, "shutting down")
            if self.worker is not None:
                await self.worker.terminate(self._grace)

    async def _lifecycle(self) -> None:
        self.consecutive = 0
        while True:
            if self.consecutive:
                delay = min(self._backoff[0] * 2 ** (self.consecutive - 1), self._backoff[1])
                log.info("backend %s: restarting in %.2fs (attempt %d)", self.name, delay,
                         self.consecutive + 1)
                await asyncio.sleep(delay)
                self.restarts += 1
                BACKEND_RESTARTS.labels(self.name).inc()
            error = await self._start()
            if error is None:
                ready_at = self._now()
                verdict = await self._watch()
                if isinstance(verdict, _Idle):
                    await self._reap(f"idle for {self._cfg.idle_unload_s:g}s")
                    return
                if self._now() - ready_at >= self._stable_s:
                    self.consecutive = 0
                self.last_error = error = verdict
                await self._reap(verdict)
            self.consecutive += 1
            if self.consecutive > self._cfg.max_restarts:
                self.last_error = f"{error} (gave up after {self.consecutive} attempts)"
                self._set_state(S.FAILED, self.last_error)
                return

    async def _start(self) -> str | None:
        """Spawn a worker and wait until it answers; None when ready, else why not."""
        port = free_port()
        self.suspect = False
        self._set_state(S.STARTING, f"port {port}")
        try:
            self.worker = await WorkerProcess.spawn(
                self._command(port), worker_env(self._cfg, self._settings), self.name,
                on_exit=self._poke.set)
        except OSError as e:
            error: str | None = f"cannot start the worker: {e}"
        else:
            self.base_url = f"http://127.0.0.1:{port}"
            error = await self._await_healthy(self.worker)
        if error is None:
            self._set_state(S.READY, f"pid {self.worker.pid}" if self.worker else "")
            self._last_used = self._now()
            return None
        # Set before the transition wakes the waiters, so they report this attempt.
        self.last_error = error
        self.start_failures += 1
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
            await wait_event(worker.exited, min(delay, remaining))
            delay = min(delay * 2, 0.5)

    async def _watch(self) -> str | _Idle:
        """While ready: until the child exits, stops answering, or has been idle too long."""
        worker = self.worker
        assert worker is not None
        idle_s, interval = self._cfg.idle_unload_s, self._cfg.health_interval_s
        next_probe, misses = self._now() + interval, 0
        while True:
            self._poke.clear()
            if worker.exited.is_set():
                return worker.describe_exit()
            if self.suspect:
                if await self._probe(2.0):
                    self.suspect = False
                    self._notify()
                    continue
                if await wait_event(worker.exited, 2.0):   # most likely it is dying: let it
                    return worker.describe_exit()
                return "worker stopped answering after a failed request"
            now = self._now()
            idle_at = self._last_used + idle_s if idle_s is not None and not self.active else None
            if idle_at is not None and now >= idle_at:
                return _Idle()
            if now >= next_probe:
                ok = await self._probe(5.0)
                misses = 0 if ok else misses + 1
                if ok != self.healthy:
                    self.healthy = ok
                    self._set_gauges()
                if misses >= HEALTH_MISSES:
                    return f"worker did not answer {HEALTH_PATH} {misses} times in a row"
                next_probe = self._now() + interval
                continue
            await wait_event(self._poke, min(next_probe, idle_at or next_probe) - now)

    async def _reap(self, why: str) -> None:
        """Make sure the current child is gone, ending in STOPPED."""
        if self.worker is not None and not self.worker.exited.is_set():
            if self.state in (S.STARTING, S.READY):
                self._set_state(S.STOPPING, why)
            await self.worker.terminate(self._grace)
        self._set_state(S.STOPPED, why)

    async def _probe(self, timeout: float) -> bool:
        if self.base_url is None:
            return False
        if self._session is None:
            self._session = local_session()
        try:
            async with self._session.get(self.base_url + HEALTH_PATH,
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return r.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
