"""The generation engine of the mlx worker: restore the longest cached prefix, prefill the rest
with checkpoints, decode, and commit what the KV state holds back to the checkpoint store.

Owns: the prefill/decode loop (so prefill chunks can end exactly at checkpoint positions), the
restore decision and its fallbacks, per-request `PromptStats`, and the worker cache metrics.
Policy (placement, lookup, budget) lives in `store.py`; per-class cache handling in `snapshot.py`.
Called from one thread only (the worker's single-thread executor), so nothing here locks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from prefixd.backends.mlx import probe, snapshot, tap
from prefixd.backends.mlx.disktier import DiskSpec, TierGlue
from prefixd.backends.mlx.placement import auto_interval, placement_marks, tail_mark
from prefixd.backends.mlx.run import Run
from prefixd.backends.mlx.stats import PromptStats
from prefixd.backends.mlx.store import CheckpointStore, Entry
from prefixd.metrics import worker as metrics

if TYPE_CHECKING:
    import mlx.nn as nn

    from prefixd.backends.mlx.settings import WorkerSettings

log = logging.getLogger("prefixd.worker.cache")


@dataclass(frozen=True)
class EngineConfig:
    """What the Engine reads of the worker's settings (same names, same meaning)."""

    cache_bytes: int = 4 * 1024**3
    checkpoint_interval: int | None = None  # None: sized automatically at start-up
    checkpoint_interval_policy: str = "bytes"   # "cost": also bounded by the pass cost
    checkpoint_inpass: bool = True              # capture inside passes where verified
    checkpoint_tail: int = 4
    prefill_chunk: int = 512
    kv_bits: int | None = None

    @classmethod
    def from_settings(cls, settings: WorkerSettings, **override: Any) -> EngineConfig:
        values = {f.name: getattr(settings, f.name) for f in fields(cls)}
        return cls(**{**values, **override})


class Engine:
    """One model, one checkpoint store, one generation at a time."""

    def __init__(self, model: nn.Module, config: EngineConfig,
                 disk: DiskSpec | None = None, model_id: str | None = None) -> None:
        self.model = model
        self.config = config
        # what identifies the model's weights (`disktier.model_fingerprint`): states move
        # only between workers of the same one (`bundle.py`)
        self.model_id = model_id or (disk.model_id if disk else None)
        self._reference: list[Any] | None = None
        self.store = CheckpointStore(config.cache_bytes)
        self.last_stats: PromptStats | None = None
        self.totals = {"requests": 0, "cached_tokens": 0, "recomputed_tokens": 0}
        self.fallbacks: dict[str, int] = {}
        self._evicted = (0, 0, 0)
        self._kv = probe.kv_quantization(model, config.kv_bits)
        if config.kv_bits and not self._kv:
            self._count_fallback("kv_quant_unsupported")
        template = self.fresh_cache()
        self._unsupported = snapshot.unsupported(template)
        if self._unsupported:
            log.warning("prompt cache disabled for this model: %s; every prompt is prefilled "
                        "cold", self._unsupported)
        self._snap_idx = () if self._unsupported else snapshot.snapshot_indices(template)
        # Windows as the only snapshotted layers: a checkpoint below the window trims back.
        self._trim_below = snapshot.trimmable_below(template, self._snap_idx)
        self.inpass = self._verify_inpass()
        self.checkpoint_bytes: int | None = None  # estimated size of one checkpoint
        self.interval_choice: probe.IntervalChoice | None = None
        self.interval = self._choose_interval()
        # RAM first, disk second (disk only when `disk` is given and the cache is supported)
        self.tiers = TierGlue(self.store, template, None if self._unsupported else disk,
                              self._snap_idx, config)
        metrics.CACHE_BUDGET.set(config.cache_bytes)
        self._update_gauges()

    # --- setup -------------------------------------------------------------------------------
    def fresh_cache(self) -> list[Any]:
        """An empty live cache of this engine's kind (KV quantized if configured)."""
        cache = make_prompt_cache(self.model)
        return snapshot.quantize_kv(cache, *self._kv) if self._kv else cache

    def _verify_inpass(self) -> tuple[int, ...] | None:
        """The snapshotted leaves, when checkpoints can be taken inside prefill passes for this
        model (`tap.verify`), else None: every checkpoint then cuts its pass."""
        if not self._snap_idx or not self.config.checkpoint_inpass:
            return None
        why = tap.verify(self.model, self.fresh_cache, self._snap_idx)
        if why:
            log.info("checkpoints cut prefill passes for this model (in-pass capture: %s)", why)
            return None
        log.info("checkpoints are taken inside prefill passes (no extra forward passes)")
        return self._snap_idx

    def _choose_interval(self) -> int:
        """`checkpoint_interval` if set, else sized to the model (`probe.choose_interval`)."""
        s = self.config
        if s.checkpoint_interval is not None:
            return s.checkpoint_interval
        if not self._snap_idx or not s.cache_bytes:
            return auto_interval(0, s.cache_bytes)  # no checkpoints are ever stored
        self.interval_choice = probe.choose_interval(self.model, self.fresh_cache,
                                                     self._snap_idx, s.cache_bytes,
                                                     s.prefill_chunk,
                                                     s.checkpoint_interval_policy == "cost"
                                                     and self.inpass is None)
        self.checkpoint_bytes = self.interval_choice.checkpoint_bytes
        return self.interval_choice.interval

    def _count_fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        metrics.FALLBACKS.labels(reason).inc()

    # --- restore -----------------------------------------------------------------------------
    def _restore(self, prompt: list[int], stats: PromptStats,
                 count: bool = True) -> tuple[list[Any], int]:
        """(live cache, tokens already in it); the fallback reason and times go to `stats`,
        the tier hit or miss to the metrics unless `count` is False (an export)."""
        t0 = time.perf_counter()
        if self._unsupported:
            self._count_fallback("unsupported_cache")
            stats.fallback = "unsupported_cache"
            return self.fresh_cache(), 0
        match = self.store.lookup(prompt)
        t1 = time.perf_counter()
        stats.lookup_s = t1 - t0
        loaded = self.tiers.restore(prompt, match.pos if match else 0, stats,
                                    self.fresh_cache, count)
        if loaded is not None:
            stats.restore_s = time.perf_counter() - t1
            return loaded.cache, loaded.pos
        if match is None:
            return self.fresh_cache(), 0
        self.tiers.used(match.entry)
        snap = match.checkpoint.payload if match.checkpoint else None
        try:
            cache = snapshot.restore(match.entry.payload, snap, match.pos)
        except Exception:
            log.exception("restore of %d cached tokens failed; prefilling cold", match.pos)
            self._count_fallback("restore_error")
            stats.fallback = "restore_error"
            return self.fresh_cache(), 0
        stats.restore_s = time.perf_counter() - t1
        return cache, match.pos

    def restore_only(self, prompt: list[int], stats: PromptStats) -> tuple[list[Any], int]:
        """`_restore` for an export (`bundle.py`): the same restore, without counting a hit
        or a miss in the tier metrics (no request is served)."""
        if self._unsupported:
            return self.fresh_cache(), 0
        return self._restore(prompt, stats, count=False)

    def reference_leaves(self) -> list[Any]:
        """This model's cache leaves after a one-token pass: the classes, array shapes and
        dtypes an imported state must have (`bundle.py`)."""
        if self._reference is None:
            cache = self.fresh_cache()
            self.model(mx.array([[0]]), cache=cache)
            snapshot.evaluate(cache)
            self._reference = snapshot.leaves(cache)
        return self._reference

    def adopt(self, tokens: list[int], cache: list[Any]) -> int:
        """Store a state another worker computed (`bundle.import_`) as if a request had ended
        at `tokens`; the tokens stored (0: the cache is unsupported or the budget refused it)."""
        if self._unsupported or not tokens:
            return 0
        held = self.store.lookup([*tokens, -1])       # restores all of it already: keep ours
        if held is not None and held.pos >= len(tokens):
            return len(tokens)
        entry = self.store.begin(tokens)
        stored = self.store.finish(entry, tokens, cache, snapshot.nbytes(cache),
                                   snapshot.trimmable(cache), self._end_snapshot)
        if stored:
            self.tiers.committed(entry)
        self._update_gauges()
        return len(tokens) if stored else 0

    # --- generation --------------------------------------------------------------------------
    def generate(self, prompt: list[int], *, sampler: Callable[[mx.array], mx.array],
                 logits_processors: list | None = None, max_tokens: int,
                 boundaries: Sequence[int] = (),
                 should_stop: Callable[[], bool] = lambda: False) -> Iterator[int]:
        """Restore, prefill (checkpointing), then yield sampled token ids until max_tokens.

        Stops early when `should_stop()` is true between prefill chunks or before a decode step,
        or when the caller closes the generator. On a normal end (max_tokens, or the caller
        closing the generator) the last yielded token is fed through the model once more, so
        the KV covers prompt + every generated token; then, on every exit, the tokens actually
        in the KV state are committed. `self.last_stats` is this request's from its start
        (cached and recomputed tokens once the prefill ended; the commit time at the end).
        """
        if not prompt:
            raise ValueError("empty prompt")
        prompt = list(prompt)
        stats = self.last_stats = PromptStats(len(prompt))
        cache, start = self._restore(prompt, stats)
        entry = None if self._unsupported else self.store.begin(prompt)
        if entry is not None and stats.tier == "disk":
            self._capture_restored(entry, cache, start)
        run = Run(self.model, cache, prompt, start, self.config.prefill_chunk, should_stop,
                  self.inpass)

        def capture(pos: int, interval: bool, payload: snapshot.Snapshot | None) -> None:
            self._capture(entry, run, pos, interval, stats, payload)

        try:
            t0 = time.perf_counter()
            logits = run.prefill(*self._plan(len(prompt), start, boundaries), capture)
            stats.prefill_s, stats.segments = time.perf_counter() - t0, run.segments
            if run.tap_failure:  # its inner checkpoints are lost; later requests cut passes
                log.warning("in-pass checkpoints failed (%s); cutting prefill passes at "
                            "checkpoints from now on", run.tap_failure)
                self._count_fallback("inpass_error")
                self.inpass = None
            self._finish_stats(stats, start, run.pos - start)
            self.tiers.prefilled(stats)
            if logits is not None:
                yield from run.decode(logits, sampler, logits_processors or [], max_tokens,
                                      stats)
        finally:
            t0 = time.perf_counter()
            self._commit(entry, run)
            self._update_gauges()
            stats.commit_s = time.perf_counter() - t0

    # --- checkpoints and commit ---------------------------------------------------------------
    def _plan(self, n: int, start: int, boundaries: Sequence[int]) -> tuple[dict[int, bool], int]:
        """(checkpoint positions of this prompt, where its last forward pass starts).

        The last pass is the only one whose logits are computed, so it is kept short: the last
        token, as stock mlx-lm's (the passes before it skip the last layer's work past what the
        cache needs, and lm_head), or from the tail mark a few tokens earlier, which then is a
        checkpoint without an extra pass. All-KV models take no checkpoints (the entry's KV
        trims to any prefix): their prefill is cut only by `prefill_chunk`."""
        if not self._snap_idx:
            return {}, n - 1
        tail = self.config.checkpoint_tail
        marks = placement_marks(n, start, boundaries, self.interval, tail,
                                trim_below=self._trim_below)
        last = tail_mark(n, [b for b in boundaries if 0 < b < n], tail)
        return marks, last if last is not None and last in marks else n - 1

    def _capture(self, entry: Entry | None, run: Run, pos: int, interval: bool,
                 stats: PromptStats, payload: snapshot.Snapshot | None = None) -> None:
        """Checkpoint at `pos`: `payload` (taken inside the pass), else the live cache, which is
        at `pos`. A failure costs the checkpoint, not the reply."""
        if entry is None:
            return
        t0 = time.perf_counter()
        try:
            if payload is None:
                payload, size = snapshot.take(run.cache, self._snap_idx)
            else:
                size = snapshot.payload_bytes(payload)
            if self.store.add_checkpoint(entry, pos, payload, size, interval=interval,
                                         trimmable=snapshot.snapshot_trimmable(payload)):
                stats.checkpoints += 1
                stats.checkpoint_bytes += size
        except Exception:
            log.exception("checkpoint at %d failed; continuing without it", pos)
            self._count_fallback("checkpoint_error")
        stats.checkpoint_s += time.perf_counter() - t0

    def _capture_restored(self, entry: Entry, cache: list[Any], pos: int) -> None:
        """Keep the state loaded from disk in RAM too (as a checkpoint of the new entry)."""
        if self._snap_idx:
            payload, size = snapshot.take(cache, self._snap_idx)
            self.store.add_checkpoint(entry, pos, payload, size,
                                      trimmable=snapshot.snapshot_trimmable(payload))

    def _commit(self, entry: Entry | None, run: Run) -> None:
        """Store what the KV state holds (the last yielded token fed first, unless should_stop()
        ended the request); drop the entry if the state is unknown or nothing is new. Never
        raises: the reply has been sent, so a failure here costs the cache entry, not the reply
        (logged and counted as `fallback="commit_error"`)."""
        if entry is None:
            return
        try:
            if self.store.budget:
                run.feed_pending()
        except Exception:  # the run is broken now, so the entry is discarded below
            log.exception("feeding the last generated token failed; not caching this request")
        try:
            if run.broken or not run.advanced:  # unknown state, or nothing the store lacks
                self.store.discard(entry)
                return
            if self.store.finish(entry, run.tokens, run.cache, snapshot.nbytes(run.cache),
                                 snapshot.trimmable(run.cache), self._end_snapshot):
                self.tiers.committed(entry)
        except Exception:
            log.exception("storing this request's prompt cache failed; the reply is unaffected")
            self._count_fallback("commit_error")
            self.store.discard(entry)

    def _finish_stats(self, stats: PromptStats, cached: int, recomputed: int) -> None:
        stats.cached_tokens, stats.recomputed_tokens = cached, recomputed
        self.totals["requests"] += 1
        self.totals["cached_tokens"] += cached
        self.totals["recomputed_tokens"] += recomputed
        metrics.CACHED_TOKENS.inc(cached)
        metrics.RECOMPUTED_TOKENS.inc(recomputed)
        metrics.RESTORE_SECONDS.observe(stats.lookup_s + stats.restore_s)
        metrics.PREFILL_SECONDS.observe(stats.prefill_s)

    def _end_snapshot(self, entry: Entry) -> tuple[Any, int, bool] | None:
        if not self._snap_idx:
            return None
        payload, size = snapshot.take(entry.payload, self._snap_idx)
        return payload, size, snapshot.snapshot_trimmable(payload)

    def _update_gauges(self) -> None:
        s = self.store
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

    def cache_info(self) -> dict:
        """JSON for GET /v1/cache."""
        info = self.store.info()
        return {
            **info,
            "hit_tokens_total": self.totals["cached_tokens"],
            "recomputed_tokens_total": self.totals["recomputed_tokens"],
            "requests_total": self.totals["requests"],
            "evictions": {"entries": info["evicted_entries"],
                          "checkpoints": info["evicted_checkpoints"],
                          "rejected": info["rejected"]},
            "fallbacks": dict(self.fallbacks),
            "disabled_reason": self._unsupported,
            "kv_bits": self._kv[0] if self._kv else None,
            "checkpoint_interval": self.interval,  # effective (the setting may be auto)
            "checkpoint_bytes_estimate": self.checkpoint_bytes,
            "checkpoint_interval_auto": (self.interval_choice.info() if self.interval_choice
                                         else None),
            "settings": {k: v for k, v in asdict(self.config).items() if k != "kv_bits"},
            "disk": self.tiers.info(),
            "misses": self.tiers.misses(),
        }

    # --- the disk tier (generation thread) ----------------------------------------------------
    def next_write_due(self) -> float | None:
        """When (time.monotonic) the next idle entry is due to be written, if any."""
        return self.tiers.next_due()

    def write_due(self) -> int:
        """Submit the writes that are due; how many entries."""
        return self.tiers.flush_due()

    def persist(self) -> None:
        """Submit everything not yet on disk (at shutdown); `close` waits for it."""
        self.tiers.flush_all()

    def close(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) for pending disk writes, then stop the writer."""
        return self.tiers.close(timeout)
