"""The managed models under one memory budget (issue 16): which workers may be loaded
together, and the `load` stage that makes room before a request's worker starts.

`ModelPool` owns the budget. Before a managed backend starts its worker, `admit()` asks the
pure policy (`backends/budget.py`) for a plan: unload the least recently used idle models, or
wait while a busy one (requests in flight or queued) is in the way — never unload it. A model
that cannot fit even alone was refused at start-up (`check()`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from prefixd.api.errors import ApiError
from prefixd.backends.budget import ModelSlot, estimate_footprint, plan_load
from prefixd.backends.managed import ManagedBackend
from prefixd.metrics import proxy as m
from prefixd.proxy.exchange import SSE_HEADERS, Exchange, ResponseState
from prefixd.proxy.queue import BackendQueue
from prefixd.proxy.stages import Next

log = logging.getLogger("prefixd.pool")
DEFAULT_SHARE = 0.75      # of physical memory: the rest is the OS, the proxy, the page cache


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def default_budget() -> int:
    return int(physical_memory() * DEFAULT_SHARE)


class ModelPool:
    def __init__(self, backends: list[ManagedBackend], queues: dict[str, BackendQueue],
                 budget: int, cache_bytes: int | None) -> None:
        self.backends = {b.name: b for b in backends}
        self.queues = queues
        self.budget = budget
        self.footprints = {b.name: estimate_footprint(_model_dir(b.model_spec),
                                                      b.cache_budget if b.cache_budget is not None
                                                      else cache_bytes)
                           for b in backends}
        self.last_used = {b.name: 0.0 for b in backends}
        m.MODEL_MEMORY_BUDGET.set(budget)
        for name, footprint in self.footprints.items():
            m.MODEL_FOOTPRINT.labels(name).set(footprint)
        self._lock = asyncio.Lock()        # one plan at a time

    def check(self) -> list[str]:
        """Models that cannot fit even alone: a start-up error, not an OOM later."""
        return [f"model {n!r} needs ~{f / 2**30:.1f} GiB (weights + cache + process) but "
                f"PREFIXD_MODEL_MEMORY_BYTES is {self.budget / 2**30:.1f} GiB"
                for n, f in self.footprints.items() if f > self.budget]

    def slots(self) -> list[ModelSlot]:
        out = []
        for name, b in self.backends.items():
            q = self.queues[name]
            out.append(ModelSlot(name, self.footprints[name], b.loaded,
                                 busy=b.busy or q.waiting > 0 or q.in_flight > 0,
                                 pinned=b.config.pin, group=b.config.group,
                                 last_used=self.last_used[name]))
        return out

    def warm_order(self) -> list[str]:
        """The models to start at start-up: pinned ones first, then in configuration order,
        as long as they fit together (and no two of one group)."""
        chosen: list[str] = []
        used, groups = 0, set()
        order = sorted(self.backends, key=lambda n: not self.backends[n].config.pin)
        for name in order:
            group = self.backends[name].config.group
            if used + self.footprints[name] <= self.budget and (group is None
                                                                or group not in groups):
                chosen.append(name)
                used += self.footprints[name]
                if group is not None:
                    groups.add(group)
        return chosen

    def status(self, name: str) -> dict:
        return {"footprint_bytes": self.footprints.get(name), "memory_budget": self.budget}

    async def admit(self, backend: ManagedBackend, on_wait=None) -> None:  # type: ignore[no-untyped-def]
        """Return when `backend` may start its worker; unload others first if needed."""
        self.last_used[backend.name] = time.monotonic()
        if backend.loaded:
            return
        t0 = time.monotonic()
        deadline = t0 + self.queues[backend.name].timeout_s
        while True:
            async with self._lock:
                # our own queue slot counts as "busy": exclude it when judging the others
                plan = plan_load(backend.name, self.slots(), self.budget)
                if not plan.fits:
                    raise ApiError(503, f"model {backend.name!r} cannot fit in the memory "
                                   f"budget beside the pinned models", code="model_too_large")
                if plan.unload and on_wait is not None:
                    await on_wait([])
                for victim in plan.unload:
                    log.info("pool: unloading %s (%s) to load %s", victim,
                             plan.reasons[victim], backend.name)
                    m.MODEL_UNLOADS.labels(victim, plan.reasons[victim]).inc()
                    await self.backends[victim].unload(f"unloaded for {backend.name} "
                                                       f"({plan.reasons[victim]})")
                if not plan.wait_for:
                    m.MODEL_LOAD_WAIT.labels(backend.name).observe(time.monotonic() - t0)
                    return
            if time.monotonic() > deadline:
                raise ApiError(503, f"model {backend.name!r} waited "
                               f"{self.queues[backend.name].timeout_s:g}s for "
                               f"{', '.join(plan.wait_for)} to finish and free memory",
                               code="model_busy")
            if on_wait is not None:
                await on_wait(plan.wait_for)
            await asyncio.sleep(0.2)       # busy models finish their requests meanwhile


def _model_dir(spec: str | None) -> Path | None:
    if not spec:
        return None
    p = Path(spec).expanduser()
    return p if p.is_dir() else None


class LoadStage:
    """load: a managed model that is not loaded gets room in the memory budget first;
    a streaming client sees `: loading model=<name>` while it waits."""

    name = "load"

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        backend = self.pool.backends.get(ex.backend.name) if ex.backend else None
        if backend is not None and not backend.loaded:
            told = False

            async def waiting(names: list[str]) -> None:
                """Making room takes a while: a streaming client hears why (once it has to
                wait; a load that simply fits keeps its plain status on failure)."""
                nonlocal told
                if ex.stream and ex.state is ResponseState.NOT_STARTED:
                    await ex.start(200, SSE_HEADERS, sse=True)
                if ex.state is not ResponseState.SSE or ex.response is None:
                    return
                if not told:
                    await ex.response.write(f": loading model={ex.model}\n\n".encode())
                    told = True
                if names:
                    await ex.response.write(f": waiting for {','.join(names)} to finish\n\n"
                                            .encode())
            await self.pool.admit(backend, waiting)
        await call_next(ex)
