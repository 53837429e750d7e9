"""Which managed models may be loaded together: the memory-budget policy (issue 16).

Pure: plans over plain data, no processes. A model to load needs its footprint (weights on
disk + its cache budget + a per-process overhead, replaced by what its worker measures once
loaded: `measured_footprint`) to fit in the budget beside what stays loaded. A model with no
cache budget of its own gets a share of the memory budget (`cache_shares`). Models of the
same `group` are never loaded together (llama-swap style). To make room, idle models are
unloaded least recently used first; a pinned model is never unloaded, and a busy one
(requests in flight or queued) is never unloaded: the new load waits for it instead.

A worker that is a group of ranks (docs/DISTRIBUTED.md) is a process and a prompt cache per
rank: a cache budget (PREFIXD_CACHE_BYTES) is each rank's. Its footprint is that of its ranks
on this machine (`Ranks`), estimated and measured alike, and a share is split among them;
the ranks on other hosts count against those hosts' memory. (Counting one process and one
cache for a group that measures one per rank made every load of it unload its neighbours:
issue 47.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prefixd.backends.mlx.group.start import is_loopback

PROCESS_OVERHEAD = 300 * 2**20      # interpreter, mlx runtime, tokenizer: measured ~250 MiB
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")
MIN_SHARE = 256 * 2**20  # a smaller cache share is not worth keeping models loaded together
SHARED_PART = 0.75       # of what the weights leave: the rest absorbs the estimate's errors


@dataclass(frozen=True)
class Ranks:
    """A worker's processes: `total` ranks (1: one process), `here` of them on this machine."""

    total: int = 1
    here: int = 1

    @classmethod
    def of(cls, hosts: list[str]) -> Ranks:
        """A backend's `hosts` (none or one: a single process): the first host is this
        machine, and so is every loopback one; the others run over ssh."""
        if len(hosts) <= 1:
            return cls()
        return cls(len(hosts), sum(on_this_machine(h, hosts[0]) for h in hosts))


def on_this_machine(host: str, first: str) -> bool:
    """A group rank's host is this machine's: the group's first host, or a loopback one."""
    return host == first or is_loopback(host)


@dataclass(frozen=True)
class ModelSlot:
    name: str
    footprint: int          # bytes it takes (or would take) when loaded
    loaded: bool            # a worker is running or starting
    busy: bool = False      # requests in flight or queued for it
    pinned: bool = False
    group: str | None = None
    last_used: float = 0.0


@dataclass(frozen=True)
class Plan:
    unload: list[str] = field(default_factory=list)       # in this order
    reasons: dict[str, str] = field(default_factory=dict)  # name -> "budget" | "group"
    wait_for: list[str] = field(default_factory=list)     # busy models in the way
    fits: bool = True       # after the unloads (and the waits), the model fits

    @property
    def ready(self) -> bool:
        """The load can start now (after the unloads)."""
        return self.fits and not self.wait_for


def plan_load(target: str, slots: list[ModelSlot], budget: int) -> Plan:
    """What to unload so `target` can load; `fits` False when it cannot fit even alone."""
    by_name = {s.name: s for s in slots}
    t = by_name[target]
    if t.loaded:
        return Plan()
    if t.footprint > budget:
        return Plan(fits=False)
    unload: list[str] = []
    reasons: dict[str, str] = {}
    wait: list[str] = []
    others = [s for s in slots if s.loaded and s.name != target]
    for s in others:
        if t.group is not None and s.group == t.group:
            if s.busy or s.pinned:
                wait.append(s.name)
            else:
                unload.append(s.name)
                reasons[s.name] = "group"
    used = sum(s.footprint for s in others if s.name not in unload)
    idle = sorted((s for s in others if s.name not in unload and not s.busy and not s.pinned),
                  key=lambda s: (s.last_used, s.name))
    while used + t.footprint > budget and idle:
        victim = idle.pop(0)
        unload.append(victim.name)
        reasons[victim.name] = "budget"
        used -= victim.footprint
    if used + t.footprint > budget:
        blocking = [s for s in others if s.name not in unload and s.busy and not s.pinned]
        if not blocking:                 # only pinned models stand in the way: never fits
            return Plan(unload, reasons, wait, fits=False)
        wait += [s.name for s in blocking if s.name not in wait]
    return Plan(unload, reasons, wait, fits=True)


def weights_bytes(model_dir: Path) -> int:
    """The size of a model folder's weight files (what loading maps into memory)."""
    if not model_dir.is_dir():
        return 0
    return sum(p.stat().st_size for p in model_dir.rglob("*")
               if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def estimate_footprint(weights: int, cache_bytes: int, ranks: Ranks = Ranks()) -> int:
    """Before a model is loaded: its weights + its prompt-cache budget + process overhead; a
    group's ranks on this machine: their part of the weights, and each its own process and
    its own cache of `cache_bytes` (the budget is per rank)."""
    return weights * ranks.here // ranks.total + ranks.here * (cache_bytes + PROCESS_OVERHEAD)


def measured_footprint(info: dict | None) -> int | None:
    """A loaded model's footprint from its worker's GET /v1/cache: the memory it holds now
    (the larger of the process's resident set and MLX's live + cached buffers, which on Apple
    silicon need not all show in the resident set) plus the room its prompt cache may still
    grow by (`bytes_budget - bytes_used`). A group worker's is the sum over its ranks on this
    machine (`on_this_machine`) of what each rank holds and the room its own cache of that
    budget has left (a follower reports its cache's bytes as `cache_bytes`); the others count
    against their own hosts' memory. None when the worker does not report its memory."""
    if not isinstance(info, dict):
        return None
    group = info.get("group")
    ranks = group.get("ranks") if isinstance(group, dict) else None
    hosts = group.get("hosts") if isinstance(group, dict) else None
    if isinstance(ranks, list) and ranks and isinstance(hosts, list) and hosts:
        local = [r for r in ranks if isinstance(r, dict) and
                 on_this_machine(str(r.get("host")), str(hosts[0]))]
    else:
        local = [info]
    held = sum(_held(r.get("memory")) for r in local)
    if held <= 0:
        return None
    budget, used = _int(info.get("bytes_budget")), _int(info.get("bytes_used"))
    return held + sum(max(0, budget - _int(r.get("cache_bytes", used))) for r in local)


def _held(memory: object) -> int:
    if not isinstance(memory, dict):
        return 0
    rss = _int(memory.get("rss_bytes"))
    return max(rss, _int(memory.get("mlx_active_bytes")) + _int(memory.get("mlx_cache_bytes")))


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


@dataclass(frozen=True)
class CacheNeed:
    """A managed model as the cache-share rule sees it."""

    name: str
    weights: int            # bytes on disk (0 when unknown: a Hub id not yet downloaded)
    cache: int | None       # its own cache budget (each rank's); None: it gets a share
    group: str | None = None
    ranks: Ranks = Ranks()


def cache_shares(models: list[CacheNeed], budget: int) -> dict[str, int]:
    """Prompt-cache budgets for the models that have none of their own, so that whatever the
    pool loads together stays within `budget`.

    The models that can be loaded at the same time are every model outside a group and one
    per group (its largest). If, beside their weights, process overheads and own cache
    budgets, the budget leaves at least `MIN_SHARE` each, three quarters of what is left is
    split evenly among them: all of them stay loaded together. Otherwise they take turns:
    each gets half of what the budget leaves beside its own weights and overhead (it fits
    alone, with room to spare for the estimate's errors).

    A share is what a model's cache takes on this machine: a group's ranks here split it
    (each rank's budget is the share over them), beside an overhead per rank counted in
    what the models need before their shares.
    """
    fixed = {m.name: estimate_footprint(m.weights, m.cache or 0, m.ranks) for m in models}
    free = [m for m in models if m.cache is None]
    if not free:
        return {}
    used, sharers = 0, 0
    groups: dict[str, list[CacheNeed]] = {}
    for m in models:
        if m.group is None:
            used += fixed[m.name]
            sharers += m.cache is None
        else:
            groups.setdefault(m.group, []).append(m)
    for members in groups.values():
        used += max(fixed[m.name] for m in members)
        sharers += any(m.cache is None for m in members)
    share = int((budget - used) * SHARED_PART) // sharers if budget > used else 0
    if share >= MIN_SHARE:
        return {m.name: share // m.ranks.here for m in free}
    return {m.name: max(0, budget - fixed[m.name]) // 2 // m.ranks.here for m in free}


def over_budget(slots: list[ModelSlot], budget: int, keep: str) -> list[str]:
    """After a loaded model measured more than its estimate: the idle models to unload (least
    recently used first, never `keep`, a pinned or a busy one) until the loaded ones fit."""
    loaded = [s for s in slots if s.loaded]
    used = sum(s.footprint for s in loaded)
    idle = sorted((s for s in loaded if s.name != keep and not s.busy and not s.pinned),
                  key=lambda s: (s.last_used, s.name))
    out: list[str] = []
    while used > budget and idle:
        victim = idle.pop(0)
        out.append(victim.name)
        used -= victim.footprint
    return out
