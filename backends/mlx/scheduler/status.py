"""What the worker reports of itself: its Engine's cache summary and MLX's memory as of the end
of the last job, its request counts, and its scheduler's jobs under way and their live caches
as of the last turn of its loop.

Owns: that snapshot. The generation loop refreshes it between two passes, after a job ends or
a call ran, and after each admission and each pass (the Engine and the scheduler are only ever
touched on the generation thread); HTTP handlers read it without waiting on that thread. A
group's other ranks are the lockstep's (their heartbeats), read as they were last heard: a
status read never waits on a rank, nor holds up a pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefixd.backends.mlx.model.memory import mlx_memory
from prefixd.backends.mlx.scheduler.jobs import Event, Finished

if TYPE_CHECKING:
    from prefixd.backends.mlx.engine.engine import Engine
    from prefixd.backends.mlx.scheduler.policy.schedule import Schedule

log = logging.getLogger("prefixd.worker")


@dataclass(frozen=True)
class UnderWay:
    """The scheduler's admitted jobs and their live caches (`room.Room`)."""

    running: int = 0       # admitted and not ended
    live_bytes: int = 0    # what their live caches hold now (one not started: its reservation)
    live_budget: int = 0   # the live caches' budget: active_kv_share of the cache budget


class Status:
    """The last snapshot (replaced whole, so a reader on another thread sees one or the
    other) and the counts."""

    def __init__(self) -> None:
        self.cache_info: dict[str, Any] = {}
        self.memory: dict[str, int] = {}   # MLX's allocator (memory.py)
        self.stats = {"requests": 0, "cancelled": 0, "completion_tokens": 0}
        self.under_way = UnderWay()
        self.kv_bytes_per_token: int | None = None   # the model's, once loaded (`sizing.py`)

    def ended(self, result: Event) -> None:
        if isinstance(result, Finished):
            self.stats["requests"] += 1
            self.stats["cancelled"] += result.finish_reason == "cancelled"
            self.stats["completion_tokens"] += result.completion_tokens

    def refresh(self, engine: Engine) -> None:
        """On the generation thread, between two passes. Never raises."""
        try:
            self.cache_info = engine.cache_info()
            self.memory = mlx_memory()
        except Exception:
            log.exception("worker: Engine.cache_info() failed")

    def scheduled(self, schedule: Schedule) -> None:
        """On the generation thread, after an admission and after a pass's jobs ended."""
        room = schedule.room
        self.under_way = UnderWay(len(schedule.active),
                                  sum(room.now(s) for s in schedule.active), room.budget)
