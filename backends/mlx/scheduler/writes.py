"""The disk writes that fall due: entries idle long enough in RAM handed to the disk tier's
writer thread (`disk/writer.py` does the I/O).

Owns: when they are handed over. Between two passes, after a job ends, and every
`PERIOD_S` while no job runs (a coroutine on the event loop that queues the hand-over on the
generation thread: handing over makes array views of store entries, which only that thread
touches). A group's leader journals the entries through the lockstep, so every rank writes
the same entries of its own layers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from prefixd.backends.mlx.scheduler.journal import WriteEntry, encode

if TYPE_CHECKING:
    from prefixd.backends.mlx.engine.engine import Engine
    from prefixd.backends.mlx.group.lockstep import Lockstep

log = logging.getLogger("prefixd.worker")

PERIOD_S = 0.25


def due(engine: Engine) -> bool:
    at = engine.next_write_due()
    return at is not None and at <= time.monotonic()


def hand_over(engine: Engine, lockstep: Lockstep, at: float | None = None) -> int:
    """On the generation thread: the entries due (at `at`, a monotonic time; None: now) to
    the writer; how many."""
    positions = engine.due_writes(at)
    if not positions:
        return 0
    lockstep.journal(encode(WriteEntry(positions)))
    return engine.write(positions)


async def tick(engine: Engine, idle: Callable[[], bool],
               run: Callable[[Callable[[], int]], Awaitable[int]],
               lockstep: Lockstep) -> None:
    """While the worker runs: every PERIOD_S, when no job runs and writes are due, hand them
    over on the generation thread (`run`). Ends when that thread is shut down."""
    while True:
        await asyncio.sleep(PERIOD_S)
        if not idle() or not due(engine):
            continue
        try:
            await run(lambda: hand_over(engine, lockstep))
        except RuntimeError:          # the generation thread is shut down
            return
        except Exception:
            log.exception("worker: submitting disk writes failed")
