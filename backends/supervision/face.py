"""What a managed worker's Backend reads of it and asks of it, apart from the task that acts.

Owns: the state the Backend (`backends/managed.py`) and the supervisor task share — the
restart counts (`lifecycle.RestartPolicy`), the requests in flight and the last use
(`lifecycle.Usage`), the current worker (its process, URL and secret token: the auth header),
its last error and a failed request's suspicion — and the Backend's side of it: reading it,
reporting requests and failures, asking for an unload, the wait until a failed backend's next
start. Nothing here starts, waits for or stops a child: what a call records pokes the task
(`supervisor.py`), which alone acts on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prefixd.backends.config import BackendConfig
from prefixd.backends.supervision.lifecycle import RestartPolicy, Usage
from prefixd.backends.supervision.process import WorkerProcess
from prefixd.backends.supervision.states import S, StateMachine


class WorkerFace(StateMachine):
    """One managed worker as its Backend sees it, and the requests the Backend records for the
    supervisor task (`Supervisor`, which extends this with the task)."""

    def __init__(self, config: BackendConfig, backoff_s: tuple[float, float], stable_s: float,
                 retry_min_s: float) -> None:
        super().__init__(config.name)
        self.policy = RestartPolicy(config, backoff_s, stable_s, retry_min_s)
        self.usage = Usage()
        self._poke = asyncio.Event()           # wakes the task (watching, or failed and waiting)
        self._task: asyncio.Task[None] | None = None
        self.worker: WorkerProcess | None = None
        self.base_url: str | None = None
        self.last_error: str | None = None
        self.start_failures = 0                # monotonic: lets waiters see a failed attempt
        self.token: str | None = None          # the running worker's secret; never published
        # Under a model pool a scheduled retry starts the worker only if it fits beside what
        # is loaded, without unloading anything (a request goes through the pool instead).
        self.may_start: Callable[[], bool] = lambda: True
        self.suspect = False                   # a request failed: verify before handing out
        self.cache_bytes = config.cache_bytes  # the worker's cache budget (the pool may set it)
        self._set_gauges()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    @property
    def restarts(self) -> int:
        return self.policy.restarts

    @property
    def consecutive(self) -> int:
        """Failed starts in a row."""
        return self.policy.consecutive

    @property
    def active(self) -> int:
        """Requests in flight."""
        return self.usage.active

    @property
    def auth(self) -> dict[str, str]:
        """The header every request to the current worker carries."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    @property
    def restarting(self) -> bool:
        """Stopped after a crash, its task waiting to start it again (it holds no memory now
        but will without asking the model pool, unless unloaded meanwhile)."""
        return self.state is S.STOPPED and self._task is not None and not self._task.done()

    def retry_in(self) -> float | None:
        """Seconds until a failed backend's next scheduled start; None when none is."""
        retry_at = self.policy.retry_at
        if self.state is not S.FAILED or retry_at is None:
            return None
        return max(0.0, retry_at - self._now())

    def request_unload(self, why: str, reason: str) -> None:
        """Stop the worker once no request is in flight (it can start again on demand)."""
        self.usage.unload = (why, reason)
        self._poke.set()

    def request_started(self) -> None:
        self.usage.active += 1
        self.usage.last_used = self._now()

    def request_ended(self) -> None:
        self.usage.active -= 1
        self.usage.last_used = self._now()
        self._poke.set()        # the idle clock restarts now

    def touch(self) -> None:
        self.usage.last_used = self._now()

    def report_failure(self) -> None:
        """A request to the worker failed: have it checked before the next one is sent."""
        if self.state is S.READY:
            self.suspect = True
            self._poke.set()
