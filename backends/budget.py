"""Which managed models may be loaded together: the memory-budget policy (issue 16).

Pure: a plan over plain data, no processes. A model to load needs its footprint (weights on
disk + its cache budget + a per-process overhead, corrected by what its worker reports once
loaded) to fit in the budget beside what stays loaded. Models of the same `group` are never
loaded together (llama-swap style). To make room, idle models are unloaded least recently
used first; a pinned model is never unloaded, and a busy one (requests in flight or queued)
is never unloaded: the new load waits for it instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

PROCESS_OVERHEAD = 300 * 2**20      # interpreter, mlx runtime, tokenizer: measured ~250 MiB
AUTO_CACHE_ESTIMATE = 2 * 2**30     # a worker sizing its own cache (PREFIXD_CACHE_BYTES unset)
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")


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


def estimate_footprint(model_dir: Path | None, cache_bytes: int | None) -> int:
    """Before a model is loaded: its weights + its prompt-cache budget + process overhead."""
    weights = weights_bytes(model_dir) if model_dir is not None else 0
    cache = AUTO_CACHE_ESTIMATE if cache_bytes is None else cache_bytes
    return weights + cache + PROCESS_OVERHEAD
