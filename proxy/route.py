"""Routing policy: which backend serves a request. Pure: decisions over plain data.

A model picks the candidate backends. Among several, cache affinity wins (the backend that
served this lane last holds its prefix) unless that backend is down or its queue is much
longer than the best alternative's; otherwise the least loaded healthy backend is chosen.
"""

from __future__ import annotations

import fnmatch
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    name: str
    up: bool
    load: int            # waiting + in flight
    max_concurrency: int


def models_index(backends: dict[str, list[str]]) -> dict[str, list[str]]:
    """model name -> backend names serving it, in configuration order."""
    index: dict[str, list[str]] = {}
    for backend, models in backends.items():
        for m in models:
            index.setdefault(m, []).append(backend)
    return index


def resolve_model(requested: str | None, index: dict[str, list[str]],
                  aliases: dict[str, str] | None = None) -> str | None:
    """The served model a request means: its own `model` if served, else the first alias
    pattern (shell-style wildcards, in configuration order) that matches it and names a
    served model; the only model when `model` is omitted."""
    if requested:
        if requested in index:
            return requested
        for pattern, target in (aliases or {}).items():
            if fnmatch.fnmatchcase(requested, pattern) and target in index:
                return target
        return None
    return next(iter(index)) if len(index) == 1 else None


def choose(candidates: list[Candidate], affinity: str | None, slack: int = 2) -> Candidate:
    """Pick one of `candidates` (non-empty).

    Affinity holds while its backend is up and its load is within `slack` requests per slot
    of the least loaded up backend: recomputing a long prefix costs more than a short wait.
    """
    up = [c for c in candidates if c.up] or candidates
    best = min(up, key=lambda c: (c.load / c.max_concurrency, candidates.index(c)))
    if affinity is not None:
        for c in up:
            if c.name == affinity and (c.load - best.load) <= slack * c.max_concurrency:
                return c
    return best


class AffinityMap:
    """lane -> backend that served it last; bounded, least recently used forgotten first."""

    def __init__(self, capacity: int = 4096) -> None:
        self._map: OrderedDict[str, str] = OrderedDict()
        self._capacity = capacity

    def get(self, lane: str | None) -> str | None:
        if lane is None or lane not in self._map:
            return None
        self._map.move_to_end(lane)
        return self._map[lane]

    def set(self, lane: str | None, backend: str) -> None:
        if lane is None:
            return
        self._map[lane] = backend
        self._map.move_to_end(lane)
        while len(self._map) > self._capacity:
            self._map.popitem(last=False)
