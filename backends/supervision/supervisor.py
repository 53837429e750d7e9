"""The lifecycle of one managed worker: the ONE task that drives its state machine.

Owns: the supervisor task, which alone starts the child (with a fresh secret token each time),
waits for its /health with a deadline, health-checks it, unloads it, stops it, and restarts it
or marks it failed as `lifecycle.RestartPolicy` decides; and the Backend's calls that start,
retry or end it. What the Backend reads and reports (counts, requests in flight, failures,
unloads asked for) is `face.py`, the base of `Supervisor`; the states, their transitions and
the one setter are `states.py`; the decisions (backoff, giving up, retries, idle unloads) are
`lifecycle.py`; the child process is `process.py`. Every wait ends at a deadline or when the
child exits.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable

import aiohttp

from prefixd.backends.config import BackendConfig
from prefixd.backends.mlx.settings import WorkerSettings
from prefixd.backends.supervision.face import WorkerFace
from prefixd.backends.supervision.health import await_healthy, local_session, probe
from prefixd.backends.supervision.lifecycle import Idle
from prefixd.backends.supervision.process import (
    EXIT_LOAD_FAILED,
    CommandBuilder,
    WorkerProcess,
    free_port,
    wait_event,
    worker_env,
)
from prefixd.backends.supervision.states import HEALTH_MISSES, HEALTH_PATH, S
from prefixd.metrics.proxy import BACKEND_RESTARTS, MODEL_LOAD_SECONDS, MODEL_LOADS, MODEL_UNLOADS

log = logging.getLogger("prefixd.backend")
# the child's environment for a start: (its secret token, the cache budget the pool gave)
EnvBuilder = Callable[[str, int | None], dict[str, str]]
SAVE_BEFORE_STOP_S = 60.0     # the most a `before_stop` hook may take


class Supervisor(WorkerFace):
    """One managed worker's task, over the state and face its Backend reads (`WorkerFace`)."""

    def __init__(self, config: BackendConfig, settings: WorkerSettings, command: CommandBuilder, *,
                 grace_s: float, backoff_s: tuple[float, float], stable_s: float,
                 retry_min_s: float, env: EnvBuilder | None = None,
                 load_failed_exit: int | None = EXIT_LOAD_FAILED) -> None:
        """`env` builds the child's environment (default: a prefixd worker's);
        `load_failed_exit` is the exit code that means it cannot load its model (no retry)."""
        super().__init__(config, backoff_s, stable_s, retry_min_s)
        self._cfg, self._settings, self._command = config, settings, command
        self._env: EnvBuilder = env or (lambda token, cache: worker_env(
            config, settings, token=token, cache_bytes=cache))
        self._load_failed_exit = load_failed_exit
        # Run while the child still answers, before it is stopped on purpose (idle or budget
        # unload, shutdown): never after a crash. Bounded by SAVE_BEFORE_STOP_S.
        self.before_stop: Callable[[], Awaitable[None]] | None = None
        self._grace = grace_s
        self._session: aiohttp.ClientSession | None = None

    # --- the task: running it, and the Backend's calls that start or end it -------------
    def start(self) -> None:
        """Run the supervisor task if the worker is stopped (or failed) and nothing runs it."""
        if self.state in (S.STOPPED, S.FAILED) and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._supervise(), name=f"supervise:{self.name}")
            # Waiters must also wake when the task ends (idle unload, a supervisor error).
            self._task.add_done_callback(lambda _: self._notify())

    def request_retry(self) -> bool:
        """A request needs this failed backend: one new start now, unless the latest began
        less than `retry_min_s` ago. True when a start is due (the caller waits for it)."""
        if self.state is not S.FAILED:
            return True
        if not self.policy.retry_wanted:
            if self.policy.too_soon(self._now()):
                return False
            self.policy.retry_wanted = True
            self._poke.set()
        self.start()
        return True

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
            # No task is left to retry on schedule; a request's retry starts a new one.
            self.policy.retry_at = None
            if self.state is S.FAILED:
                self.last_error = f"supervisor error: {e!r}"
            else:
                await self._reap("supervisor error")
                self._fail(f"supervisor error: {e!r}", scheduled=False)
        finally:
            # Cancelled by stop() (or the loop ending): the child must not outlive us.
            if self.state is S.READY:
                await self._before_stop()
            if self.state in (S.STARTING, S.READY):
                self._set_state(S.STOPPING, "shutting down")
            if self.worker is not None:
                await self.worker.terminate(self._grace)

    async def _lifecycle(self) -> None:
        """Start, watch, restart, fail and retry until idle-unloaded (or cancelled)."""
        p = self.policy
        p.setbacks, first = 0, True
        while True:
            if self.state is S.FAILED:
                await self._until_retry()
            elif p.setbacks:
                delay = p.backoff()
                log.info("backend %s: restarting in %.2fs", self.name, delay)
                if not await self._backoff_unless_unloaded(delay):
                    return
            if not first:
                p.restarts += 1
                BACKEND_RESTARTS.labels(self.name).inc()
            first, retrying = False, self.state is S.FAILED
            error, load_failed = await self._start()
            if error is None:                           # ready: watch it until it ends
                p.consecutive, ready_at = 0, self._now()
                verdict = await self._watch()
                MODEL_UNLOADS.labels(self.name, verdict.reason if isinstance(verdict, Idle)
                                     else "failure").inc()
                if isinstance(verdict, Idle):
                    await self._reap(verdict.why, on_purpose=True)
                    return
                p.ran(self._now() - ready_at)
                self.last_error = verdict
                await self._reap(verdict)
                continue
            failed = p.start_failed(error, load_failed, retrying)
            if failed is not None:
                self._fail(failed)

    async def _backoff_unless_unloaded(self, delay: float) -> bool:
        """Wait `delay` before a restart; False (no restart) once an unload is asked for: the
        memory budget gave the crashed model's room to another one."""
        end = self._now() + delay
        while self.usage.unload is None and end > self._now():
            self._poke.clear()
            await wait_event(self._poke, end - self._now())
        if self.usage.unload is None:
            return True
        log.info("backend %s: not restarted (%s)", self.name, self.usage.unload[0])
        self.usage.unload = None
        return False

    def _fail(self, why: str, scheduled: bool = True) -> None:
        """Enter FAILED (from STOPPED), with the next scheduled retry already known."""
        self.last_error = why
        self.usage.unload = None               # nothing loaded to unload
        if scheduled:
            self.policy.schedule_retry(self._now())
        self._set_state(S.FAILED, why + (f"; retrying in {self._cfg.retry_failed_s:g}s"
                                         if scheduled else ""))

    async def _until_retry(self) -> None:
        """While failed: wait for the scheduled retry or a request asking for one."""
        p = self.policy
        due = p.retry_at if p.retry_at is not None else p.schedule_retry(self._now())
        while True:
            self._poke.clear()
            if p.retry_wanted:
                break
            if self._now() >= due:
                if self.may_start():
                    break
                due = p.schedule_retry(self._now())    # no room now
            await wait_event(self._poke, due - self._now())
        log.info("backend %s: trying again after failing (%s)", self.name,
                 "a request asked" if p.retry_wanted else "scheduled")
        p.retry_wanted, p.retry_at = False, None

    async def _start(self) -> tuple[str | None, bool]:
        """Spawn a worker and wait until it answers: (None, False) when ready, else (why not,
        whether it exited because it cannot load its model or settings)."""
        port = free_port()
        self.suspect = False
        self.worker = None
        self.policy.last_attempt = self._now()
        self.token = secrets.token_urlsafe(32)
        self._set_state(S.STARTING, f"port {port}")
        try:
            self.worker = await WorkerProcess.spawn(
                self._command(port), self._env(self.token, self.cache_bytes),
                self.name, on_exit=self._poke.set)
        except OSError as e:
            error: str | None = f"cannot start the worker: {e}"
        else:
            self.base_url = f"http://127.0.0.1:{port}"
            error = await await_healthy(self.worker, self._probe, self._cfg.startup_timeout_s,
                                        self._now, self._cfg.startup_probe_max_s)
        MODEL_LOADS.labels(self.name, "failed" if error else "ready").inc()
        if error is None:
            MODEL_LOAD_SECONDS.labels(self.name).observe(self._now() - self.policy.last_attempt)
            self._set_state(S.READY, f"pid {self.worker.pid}" if self.worker else "")
            self.usage.last_used = self._now()
            return None, False
        load_failed = (self.worker is not None and self._load_failed_exit is not None
                       and self.worker.returncode == self._load_failed_exit)
        # Set before the transition wakes the waiters, so they report this attempt.
        self.last_error = error
        self.start_failures += 1
        await self._reap(error)
        return error, load_failed

    async def _watch(self) -> str | Idle:
        """While ready: until the child exits, stops answering, or has been idle too long."""
        worker = self.worker
        assert worker is not None
        idle_s, interval = self._cfg.ttl_s, self._cfg.health_interval_s
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
            verdict, idle_at = self.usage.idle(now, idle_s)
            if verdict is not None:
                return verdict
            if now >= next_probe:
                # a probe waits at most 5 s, less where probes are frequent (2 intervals,
                # at least 1 s): a frozen worker is found within about HEALTH_MISSES of them
                ok = await self._probe(min(5.0, max(1.0, 2 * interval)))
                misses = 0 if ok else misses + 1
                if ok != self.healthy:
                    self.healthy = ok
                    self._set_gauges()
                if misses >= HEALTH_MISSES:
                    return f"worker did not answer {HEALTH_PATH} {misses} times in a row"
                next_probe = self._now() + interval
                continue
            await wait_event(self._poke, min(next_probe, idle_at or next_probe) - now)

    async def _before_stop(self) -> None:
        """The `before_stop` hook, once, bounded; its failure is logged, never raised."""
        hook = self.before_stop
        if hook is None or self.worker is None or self.worker.exited.is_set():
            return
        try:
            async with asyncio.timeout(SAVE_BEFORE_STOP_S):
                await hook()
        except Exception as e:
            log.warning("backend %s: before stopping: %r", self.name, e)

    async def _reap(self, why: str, on_purpose: bool = False) -> None:
        """Make sure the current child is gone, ending in STOPPED (`on_purpose`: an unload,
        so the `before_stop` hook runs first)."""
        if on_purpose and self.state is S.READY:
            await self._before_stop()
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
        return await probe(self._session, self.base_url, self.auth, timeout)
