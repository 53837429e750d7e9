"""Exit with the parent: a process started by another prefixd process (a worker under the
proxy, the proxy under `prefixd demo`) gets the parent's pid in `PREFIXD_PARENT_PID` and
stops when that parent is gone, even after a SIGKILL, so nothing is left orphaned."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger("prefixd.parent")

PARENT_PID_ENV = "PREFIXD_PARENT_PID"
PARENT_POLL_S = 1.0
_PR_SET_PDEATHSIG = 1


def follow_parent() -> int | None:
    """On Linux ask the kernel for SIGTERM when the parent dies; return the pid to poll
    (None when no parent was named). Exits at once if the parent is already gone."""
    raw = os.environ.get(PARENT_PID_ENV, "")
    if not raw.isdigit():
        if raw:
            log.warning("ignoring %s=%r (not a pid)", PARENT_PID_ENV, raw)
        return None
    expected = int(raw)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != expected:  # it died before prctl took effect
        log.warning("parent %d is already gone; exiting", expected)
        raise SystemExit(0)
    return expected


async def watch_parent(expected: int, stop: asyncio.Event) -> None:
    """Set `stop` once the parent is gone (macOS has no PDEATHSIG: an orphan is re-parented,
    which getppid() shows)."""
    while os.getppid() == expected:
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("parent %d is gone; shutting down", expected)
    stop.set()
