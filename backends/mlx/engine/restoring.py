"""Restoring a prompt's longest cached prefix into a live cache: the part of the Engine
(`engine/engine.py`, a mixin of it) that reads the store and the disk tier, and what it
stores that no request computed here (a state imported from another worker, a prefix a running
request publishes). In a group every rank restores or none does (`group/lockstep.py`).
Generation thread only, like the rest of the Engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.stats import PromptStats

if TYPE_CHECKING:
    from prefixd.backends.mlx.cache.store import CheckpointStore, Entry
    from prefixd.backends.mlx.engine.counts import CacheCounts
    from prefixd.backends.mlx.engine.tierglue import TierGlue
    from prefixd.backends.mlx.group.lockstep import Lockstep

log = logging.getLogger("prefixd.worker.cache")


class Restoring:
    """The Engine's restores and adoptions (its state: the Engine's own)."""

    model: Any
    store: CheckpointStore
    lockstep: Lockstep
    counts: CacheCounts
    tiers: TierGlue
    logits_bytes: int
    _reference: list[Any] | None
    _unsupported: str | None
    fresh_cache: Callable[[], list[Any]]
    _end_snapshot: Callable[[Entry], tuple[Any, int, bool] | None]

    def _restore(self, prompt: list[int], stats: PromptStats, count: bool = True,
                 namespace: str = "") -> tuple[list[Any], int]:
        """(live cache, tokens already in it) from the request's cache partition (`namespace`);
        the fallback reason and times go to `stats`, the tier hit or miss to the metrics unless
        `count` is False (an export)."""
        t0 = time.perf_counter()
        if self._unsupported:
            self.counts.fallback("unsupported_cache")
            stats.fallback = "unsupported_cache"
            return self.fresh_cache(), 0
        match = self.store.lookup(prompt, namespace)
        t1 = time.perf_counter()
        stats.lookup_s = t1 - t0
        loaded = self.tiers.restore(prompt, match.pos if match else 0, stats,
                                    self.fresh_cache, count, namespace,
                                    self.store.shared(prompt, namespace))
        if loaded is not None:
            stats.restore_s = time.perf_counter() - t1
            return loaded.cache, loaded.pos
        if match is None:
            return self.fresh_cache(), 0
        self.tiers.used(match.entry)
        snap = match.checkpoint.payload if match.checkpoint else None
        try:
            cache: list[Any] | None = snapshot.restore(match.entry.payload, snap, match.pos)
        except Exception:
            log.exception("restore of %d cached tokens failed; prefilling cold", match.pos)
            cache = None
        # a group restores on every rank or on none: a rank that cannot makes the request cold
        if not self.lockstep.all(cache is not None) or cache is None:
            reason = "restore_error" if cache is None else "group_restore_error"
            self.counts.fallback(reason)
            stats.fallback = reason
            return self.fresh_cache(), 0
        stats.restore_s = time.perf_counter() - t1
        return cache, match.pos

    def restore_only(self, prompt: list[int], stats: PromptStats,
                     namespace: str = "") -> tuple[list[Any],
                     int]:
        """`_restore` for an export (`engine/transfer/bundle.py`): the same restore, without
        counting a hit or a miss in the tier metrics (no request is served)."""
        if self._unsupported:
            return self.fresh_cache(), 0
        return self._restore(prompt, stats, count=False, namespace=namespace)

    def cached_now(self, prompt: Sequence[int], namespace: str = "") -> int:
        """Prompt tokens a restore from RAM would reuse now (the scheduler's estimate of a
        waiting job's remaining prefill; nothing is restored or marked used)."""
        match = None if self._unsupported else self.store.peek(prompt, namespace)
        return match.pos if match else 0

    def reference_leaves(self) -> list[Any]:
        """This model's cache leaves after a one-token pass: the classes, array shapes and
        dtypes an imported state must have (`engine/transfer/bundle.py`)."""
        if self._reference is None:
            cache = self.fresh_cache()
            logits = self.model(mx.array([[0]]), cache=cache)
            snapshot.evaluate(cache)
            self._reference = snapshot.leaves(cache)
            self.logits_bytes = logits.nbytes   # one position's
        return self._reference

    def adopt(self, tokens: list[int], cache: list[Any], namespace: str = "") -> int:
        """Store a state another worker computed (`bundle.import_`), or a prefix this one
        publishes (`_publish`), as if a request of `namespace` had ended at `tokens`; the
        tokens stored (0: the cache is unsupported or the budget refused it)."""
        if self._unsupported or not tokens:
            return 0
        held = self.store.lookup([*tokens, -1], namespace)   # restores all of it: keep ours
        if held is not None and held.pos >= len(tokens):
            return len(tokens)
        entry = self.store.begin(tokens, namespace)   # the same decision on every rank
        stored = self.store.finish(entry, tokens, cache,
                                   self.lockstep.max(snapshot.nbytes(cache)),
                                   self.lockstep.all(snapshot.trimmable(cache)),
                                   self._end_snapshot)
        if stored:
            self.tiers.committed(entry)
        self.counts.gauges(self.store)
        return len(tokens) if stored else 0
