"""Whether a managed worker answers: the session to a local worker, one health probe, and the
start-up wait for the first good probe. Stateless: the supervisor owns the worker and its
state, and passes in what these need.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp

from prefixd.backends.supervision.process import WorkerProcess, wait_event
from prefixd.backends.supervision.states import HEALTH_PATH


def local_session() -> aiohttp.ClientSession:
    """A session to a local worker, without keep-alive (a new connection is cheap on
    loopback): no request goes out on a connection left from an earlier worker, so a refused
    or dropped connection always means this request's worker died before answering it."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=None))


async def probe(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str],
                timeout: float) -> bool:
    """One GET of the worker's health path: True on a 200 within `timeout`."""
    try:
        async with session.get(base_url + HEALTH_PATH, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


async def await_healthy(worker: WorkerProcess, check: Callable[[float], Awaitable[bool]],
                        timeout: float, now: Callable[[], float],
                        max_delay: float = 0.5) -> str | None:
    """Probe (backing off from 50 ms to `max_delay`) until the worker answers (None), exits,
    or `timeout` passes (why not, for the error)."""
    deadline = now() + timeout
    delay = min(0.05, max_delay)
    while True:
        if worker.exited.is_set():
            return f"{worker.describe_exit()} (during start-up)"
        remaining = deadline - now()
        if remaining <= 0:
            tail = worker.stderr_tail()
            return (f"worker timed out after {timeout:g}s without answering {HEALTH_PATH}"
                    + (f"; last output: {tail[-1]}" if tail else ""))
        if await check(min(5.0, remaining)):
            return None
        await wait_event(worker.exited, min(delay, remaining))
        delay = min(delay * 2, max_delay)
