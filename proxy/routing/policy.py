"""Routing policy: which backend serves a request. Pure: decisions over plain data.

A model picks the candidate backends. Among several, the one holding the longest prefix of
the request (the prefix index) wins, then the one that served the conversation last, unless
that backend is down or its queue is much longer than the least loaded one's (`Balance`). A
conversation no backend knows goes to a rendezvous-hash choice on its stable head, so two
proxies that share no state still send it to the same backend, and new ones spread evenly.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    name: str
    up: bool
    load: int            # waiting + in flight
    max_concurrency: int
    cached: int = 0      # tokens of this conversation's own prefix the index says it holds
    shared: int = 0      # tokens it holds of the request's prefix, shared ones included


@dataclass(frozen=True)
class Decision:
    name: str
    reason: str          # affinity | index_hit | balance | failover | new
    predicted: int       # cached tokens expected on that backend


@dataclass(frozen=True)
class Balance:
    """When affinity yields to load: the chosen backend's queue exceeds the least loaded
    one's by more than `slack` requests per slot AND by more than `ratio` times. Set by
    `PREFIXD_ROUTE_BALANCE_SLACK`, `PREFIXD_ROUTE_BALANCE_RATIO`, `PREFIXD_ROUTE_MIN_HIT_TOKENS`."""

    slack: int = 2
    ratio: float = 2.0
    min_hit_tokens: int = 32     # a shorter shared prefix is not worth a longer wait


# decide()'s shape: (candidates, the lane's last backend, the conversation's key) -> Decision
Policy = Callable[[list["Candidate"], "str | None", str], "Decision"]


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


def alias_for(requested: str, aliases: dict[str, str]) -> tuple[str, str] | None:
    """(pattern, target) of the first alias pattern that matches `requested`, served or not."""
    return next(((p, t) for p, t in aliases.items() if fnmatch.fnmatchcase(requested, p)), None)


def unserved_aliases(aliases: dict[str, str], index: dict[str, list[str]]) -> list[str]:
    """An alias whose target no backend serves can only fail: one line per such alias."""
    return [f"PREFIXD_MODEL_ALIASES maps {pattern!r} to {target!r}, which no backend serves "
            f"(served: {sorted(index)})" for pattern, target in aliases.items()
            if target not in index]


def _per_slot(c: Candidate) -> float:
    return c.load / c.max_concurrency


def rendezvous(key: str, names: list[str]) -> str:
    """The highest-random-weight choice: the same for every proxy that knows the same
    backends, stable when one is added or removed (only its share moves)."""
    return max(names, key=lambda n: hashlib.blake2b(f"{key}|{n}".encode(),
                                                    digest_size=8).digest())


def decide(candidates: list[Candidate], affinity: str | None, conversation: str,
           policy: Balance = Balance()) -> Decision:
    """Pick one of `candidates` (non-empty): the longest indexed prefix, else the lane's
    last backend, else a rendezvous choice for a new conversation — each unless it is
    overloaded against the least loaded backend; down backends only if all are down."""
    up = [c for c in candidates if c.up]
    if not up:
        return Decision(candidates[0].name, "failover", 0)
    least = min(up, key=lambda c: (_per_slot(c), candidates.index(c)))

    def fits(c: Candidate) -> bool:
        extra = c.load - least.load
        return not (extra > policy.slack * c.max_concurrency
                    and c.load > policy.ratio * max(1, least.load))

    by_name = {c.name: c for c in candidates}
    hit = max(up, key=lambda c: (c.cached, -_per_slot(c), -candidates.index(c)))
    if hit.cached >= policy.min_hit_tokens and fits(hit):
        return Decision(hit.name, "affinity" if hit.name == affinity else "index_hit",
                        hit.shared)
    lane = by_name.get(affinity) if affinity else None
    if lane is not None and lane.up and fits(lane):
        return Decision(lane.name, "affinity", lane.shared)
    if hit.cached >= policy.min_hit_tokens or (lane is not None and lane.up):
        return Decision(least.name, "balance", least.shared)
    if lane is not None:                  # its backend is down
        return Decision(least.name, "failover", least.shared)
    # A conversation no backend knows (a shared system prompt alone does not count: every
    # backend soon holds it): the same choice on every proxy, spread over the backends.
    fresh = by_name[rendezvous(conversation, [c.name for c in up])]
    if fits(fresh):
        return Decision(fresh.name, "new", fresh.shared)
    return Decision(least.name, "balance", least.shared)


def transfer_source(target: str, have: dict[str, int], min_tokens: int) -> tuple[str, int] | None:
    """Where to copy this request's prefix from before `target` serves it: the backend holding
    (or computing) the most tokens of it, when that is at least `min_tokens` more than the
    target holds; None otherwise (`min_tokens` 0: never). `have`: backend -> tokens of the
    request's prefix it holds or is computing, over the backends that move state."""
    if min_tokens <= 0:
        return None
    best: tuple[str, int] | None = None
    for name, tokens in have.items():            # ties: the first in configuration order
        if name != target and (best is None or tokens > best[1]):
            best = (name, tokens)
    if best is None or best[1] - have.get(target, 0) < min_tokens:
        return None
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
