"""The managed worker's process states and the transitions between them (the table the
supervisor's one `_set_state()` checks), and the health-probe constants."""

from __future__ import annotations

from enum import StrEnum

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
