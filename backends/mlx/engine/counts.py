"""The Engine's running counts and the worker's prompt-cache metrics.

Owns: the totals since start (requests, cached and recomputed tokens), the fallbacks by reason,
and the Prometheus series of the RAM prompt cache (`metrics/worker.py`): its budget, bytes and
entries, evictions (the store's own counts turned into increments), cached and recomputed
tokens, and each request's restore and prefill times. It reads the checkpoint store and never
changes it. Generation thread only, like the Engine that calls it.
"""

from __future__ import annotations

from typing import Any

from prefixd.backends.mlx.cache.store import CheckpointStore
from prefixd.backends.mlx.engine.stats import PromptStats
from prefixd.metrics import worker as metrics


class CacheCounts:
    def __init__(self) -> None:
        self.totals = {"requests": 0, "cached_tokens": 0, "recomputed_tokens": 0}
        self.fallbacks: dict[str, int] = {}
        self._evicted = (0, 0, 0)          # the store's counts the metrics have seen

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        metrics.FALLBACKS.labels(reason).inc()

    def request(self, stats: PromptStats, cached: int, recomputed: int) -> None:
        """A request's prefill ended: `cached` tokens restored, `recomputed` prefilled."""
        stats.cached_tokens, stats.recomputed_tokens = cached, recomputed
        self.totals["requests"] += 1
        self.totals["cached_tokens"] += cached
        self.totals["recomputed_tokens"] += recomputed
        metrics.CACHED_TOKENS.inc(cached)
        metrics.RECOMPUTED_TOKENS.inc(recomputed)
        metrics.RESTORE_SECONDS.observe(stats.lookup_s + stats.restore_s)
        metrics.PREFILL_SECONDS.observe(stats.prefill_s)

    @staticmethod
    def budget(nbytes: int) -> None:
        metrics.CACHE_BUDGET.set(nbytes)

    def gauges(self, s: CheckpointStore) -> None:
        """The store's size now, and its evictions since the last call."""
        kv = sum(e.nbytes for e in s.entries)
        metrics.CACHE_BYTES.labels("kv").set(kv)
        metrics.CACHE_BYTES.labels("checkpoint").set(s.bytes_used - kv)
        metrics.CACHE_ENTRIES.labels("entry").set(len(s.entries))
        metrics.CACHE_ENTRIES.labels("checkpoint").set(sum(len(e.checkpoints) for e in s.entries))
        now = (s.evicted_entries, s.evicted_checkpoints, s.rejected)
        for kind, new, old in zip(("entry", "checkpoint", "rejected"), now, self._evicted,
                                  strict=True):
            if new > old:
                metrics.EVICTIONS.labels(kind).inc(new - old)
        self._evicted = now

    def info(self, store_info: dict[str, Any]) -> dict[str, Any]:
        """The counts' part of GET /v1/cache (`store_info`: the store's own `info()`)."""
        return {
            "hit_tokens_total": self.totals["cached_tokens"],
            "recomputed_tokens_total": self.totals["recomputed_tokens"],
            "requests_total": self.totals["requests"],
            "evictions": {"entries": store_info["evicted_entries"],
                          "checkpoints": store_info["evicted_checkpoints"],
                          "rejected": store_info["rejected"]},
            "fallbacks": dict(self.fallbacks),
        }
