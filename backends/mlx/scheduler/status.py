"""What the worker reports of itself: its Engine's cache summary and MLX's memory as of the end
of the last job, and its request counts.

Owns: that snapshot. The generation loop refreshes it between two passes, after a job ends or
a call ran (the Engine is only ever touched on the generation thread); HTTP handlers read it
without waiting on that thread. A group's other ranks are the lockstep's (their heartbeats),
read as they were last heard: a status read never waits on a rank, nor holds up a pass.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from prefixd.backends.mlx.model.memory import mlx_memory
from prefixd.backends.mlx.scheduler.jobs import Event, Finished

if TYPE_CHECKING:
    from prefixd.backends.mlx.engine.engine import Engine

log = logging.getLogger("prefixd.worker")


class Status:
    """The last snapshot (replaced whole, so a reader on another thread sees one or the
    other) and the counts."""

    def __init__(self) -> None:
        self.cache_info: dict[str, Any] = {}
        self.memory: dict[str, int] = {}   # MLX's allocator (memory.py)
        self.stats = {"requests": 0, "cancelled": 0, "completion_tokens": 0}

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
