"""The managed worker's process states, the transitions between them, and the one place a
state changes (`StateMachine._set_state()`: checks the table, logs, sets the state/up gauges,
wakes waiters); and the health-probe constants."""

from __future__ import annotations

import asyncio
import logging
from enum import StrEnum

from prefixd.metrics.proxy import BACKEND_STATE, BACKEND_UP

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
    S.FAILED: frozenset({S.STARTING, S.SHUTDOWN}),              # STARTING: a retry
    S.SHUTDOWN: frozenset(),
}


class StateMachine:
    """One backend's state and health, read by anyone, changed only by `_set_state()` (and
    `healthy` by the health checks, which then call `_set_gauges()`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = S.STOPPED
        self.healthy = False
        self.changed = asyncio.Event()         # replaced on every change: wait on the current

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
