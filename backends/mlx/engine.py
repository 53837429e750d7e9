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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from prefixd.backends.mlx import snapshot
from prefixd.backends.mlx.store import CheckpointStore, Entry, auto_interval, placement_marks
from prefixd.metrics import worker as metrics

if TYPE_CHECKING:
    import mlx.nn as nn

    from prefixd.backends.mlx.settings import WorkerSettings

log = logging.getLogger("prefixd.worker.cache")


@dataclass
class PromptStats:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens restored from the cache (not recomputed)
    recomputed_tokens: int  # prompt tokens actually run through the model
    restore_s: float
    prefill_s: float
    fallback: str | None = None  # why the cache was bypassed, else None


class Engine:
    """One model, one checkpoint store, one generation at a time."""

    def __init__(self, model: nn.Module, settings: WorkerSettings) -> None:
        self.model = model
        self.settings = settings
        self.store = CheckpointStore(settings.cache_bytes)
        self.last_stats: PromptStats | None = None
        self.totals = {"requests": 0, "cached_tokens": 0, "recomputed_tokens": 0}
        self.fallbacks: dict[str, int] = {}
        self._evicted = (0, 0, 0)
        self._kv = self._kv_quantization(settings.kv_bits)
        template = self._fresh_cache()
        self._unsupported = snapshot.unsupported(template)
        if self._unsupported:
            log.warning("prompt cache disabled for this model: %s; every prompt is prefilled "
                        "cold", self._unsupported)
        self._snap_idx = () if self._unsupported else snapshot.snapshot_indices(template)
        self.checkpoint_bytes: int | None = None  # estimated size of one checkpoint
        self.interval = self._choose_interval()
        metrics.CACHE_BUDGET.set(settings.cache_bytes)
        self._update_gauges()

    # --- setup -------------------------------------------------------------------------------
    def _fresh_cache(self) -> list[Any]:
        cache = make_prompt_cache(self.model)
        return snapshot.quantize_kv(cache, *self._kv) if self._kv else cache

    def _kv_quantization(self, bits: int | None) -> tuple[int, int] | None:
        """(bits, group_size) that this model's attention accepts, or None (full precision)."""
        if not bits:
            return None
        for group in (64, 32):
            cache = snapshot.quantize_kv(make_prompt_cache(self.model), bits, group)
            try:
                mx.eval(self.model(mx.array([[0]]), cache=cache))
            except Exception as exc:  # mlx raises plain ValueError/RuntimeError here
                log.debug("kv_bits=%d group %d rejected: %s", bits, group, exc)
                continue
            return bits, group
        log.warning("kv_bits=%d is not supported by this model; keeping the KV cache in full "
                    "precision", bits)
        self._count_fallback("kv_quant_unsupported")
        return None

    def _choose_interval(self) -> int:
        """`checkpoint_interval` if set, else sized to the model's checkpoints and the budget."""
        s = self.settings
        if s.checkpoint_interval is not None:
            return s.checkpoint_interval
        if not self._snap_idx or not s.cache_bytes:
            return auto_interval(0, s.cache_bytes)  # no checkpoints are ever stored
        probe = self._fresh_cache()
        mx.eval(self.model(mx.array([[0]]), cache=probe))
        snapshot.evaluate(probe)
        self.checkpoint_bytes = snapshot.checkpoint_bytes(probe, self._snap_idx, s.prefill_chunk)
        interval = auto_interval(self.checkpoint_bytes, s.cache_bytes)
        log.info("checkpoint interval %d tokens (auto: %.3g MiB per checkpoint, budget %.3g "
                 "GiB)", interval, self.checkpoint_bytes / 2**20, s.cache_bytes / 2**30)
        return interval

    def _count_fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        metrics.FALLBACKS.labels(reason).inc()

    # --- restore -----------------------------------------------------------------------------
    def _restore(self, prompt: list[int]) -> tuple[list[Any], int, str | None]:
        """(live cache, tokens already in it, fallback reason)."""
        if self._unsupported:
            self._count_fallback("unsupported_cache")
            return self._fresh_cache(), 0, "unsupported_cache"
        match = self.store.lookup(prompt)
        if match is None:
            return self._fresh_cache(), 0, None
        snap = match.checkpoint.payload if match.checkpoint else None
        try:
            return snapshot.restore(match.entry.payload, snap, match.pos), match.pos, None
        except Exception:
            log.exception("restore of %d cached tokens failed; prefilling cold", match.pos)
            self._count_fallback("restore_error")
            return self._fresh_cache(), 0, "restore_error"

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
        in the KV state are committed. `self.last_stats` is set before the first token.
        """
        if not prompt:
            raise ValueError("empty prompt")
        prompt = list(prompt)
        t0 = time.perf_counter()
        cache, start, fallback = self._restore(prompt)
        restore_s = time.perf_counter() - t0
        entry = None if self._unsupported else self.store.begin(prompt)
        run = _Run(self, cache, prompt, start, entry, should_stop)
        try:
            logits = run.prefill(boundaries)
            self._finish_stats(PromptStats(len(prompt), start, run.pos - start, restore_s,
                                           time.perf_counter() - t0 - restore_s, fallback))
            if logits is not None:
                yield from run.decode(logits, sampler, logits_processors or [], max_tokens)
        finally:
            run.commit()
            self._update_gauges()

    def _finish_stats(self, stats: PromptStats) -> None:
        self.last_stats = stats
        self.totals["requests"] += 1
        self.totals["cached_tokens"] += stats.cached_tokens
        self.totals["recomputed_tokens"] += stats.recomputed_tokens
        metrics.CACHED_TOKENS.inc(stats.cached_tokens)
        metrics.RECOMPUTED_TOKENS.inc(stats.recomputed_tokens)
        metrics.RESTORE_SECONDS.observe(stats.restore_s)
        metrics.PREFILL_SECONDS.observe(stats.prefill_s)
        log.debug("prompt %d tokens: %d cached, %d recomputed, restore %.4fs, prefill %.3fs%s",
                  stats.prompt_tokens, stats.cached_tokens, stats.recomputed_tokens,
                  stats.restore_s, stats.prefill_s,
                  f", fallback {stats.fallback}" if stats.fallback else "")

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
            "settings": {k: getattr(self.settings, k) for k in (
                "cache_bytes", "checkpoint_interval", "checkpoint_tail", "prefill_chunk")},
        }


class _Run:
    """The live state of one generation: its cache, how far it got, and its store entry."""

    def __init__(self, engine: Engine, cache: list[Any], prompt: list[int], start: int,
                 entry: Entry | None, should_stop: Callable[[], bool]) -> None:
        self.engine, self.cache, self.prompt, self.entry = engine, cache, prompt, entry
        self.start, self.should_stop = start, should_stop
        self.pos = start  # prompt tokens in the KV state
        self.fed: list[int] = []  # generated tokens in the KV state
        self.pending: int | None = None  # the last yielded token, not yet fed to the model
        self.broken = False  # an exception hit mid-forward: the cache state is unknown

    def _forward(self, tokens: list[int]) -> mx.array:
        self.broken = True
        out = self.engine.model(mx.array(tokens)[None], cache=self.cache)
        snapshot.evaluate(self.cache)
        self.broken = False
        return out

    def _checkpoint(self, marks: dict[int, bool]) -> None:
        e = self.engine
        if self.entry is None or not e._snap_idx or self.pos not in marks:
            return
        payload, size = snapshot.take(self.cache, e._snap_idx)
        e.store.add_checkpoint(self.entry, self.pos, payload, size, interval=marks[self.pos],
                               trimmable=snapshot.snapshot_trimmable(payload))

    def prefill(self, boundaries: Sequence[int]) -> mx.array | None:
        """Run prompt[pos:] through the model; the last token's logits, None if stopped."""
        s = self.engine.settings
        n = len(self.prompt)
        # All-KV models need no checkpoints (the entry's KV trims to any prefix): no extra cuts.
        marks = (placement_marks(n, self.pos, boundaries, self.engine.interval,
                                 s.checkpoint_tail) if self.engine._snap_idx else {})
        cuts = sorted(p for p in marks if p < n - 1)
        while self.pos < n - 1:
            if self.should_stop():
                return None
            end = min([n - 1, self.pos + s.prefill_chunk, *(p for p in cuts if p > self.pos)])
            # Prefill logits are never evaluated, so lm_head over the chunk is never computed.
            self._forward(self.prompt[self.pos:end])
            self.pos = end
            self._checkpoint(marks)
            mx.clear_cache()
        if self.should_stop():
            return None
        logits = self._forward(self.prompt[n - 1:])[:, -1, :]
        self.pos = n
        self._checkpoint(marks)
        return logits

    def decode(self, logits: mx.array, sampler: Callable[[mx.array], mx.array],
               processors: list, max_tokens: int) -> Iterator[int]:
        for i in range(max_tokens):
            if processors:
                history = mx.array(self.prompt + self.fed)
                for proc in processors:
                    logits = proc(history, logits)
            token = int(sampler(logits - mx.logsumexp(logits, keepdims=True)).item())
            self.pending = token
            yield token
            if i == max_tokens - 1 or self.should_stop():
                return
            logits = self._forward([token])[:, -1, :]
            self.fed.append(token)
            self.pending = None

    def _feed_pending(self) -> None:
        """Feed the last yielded token on a normal end (max_tokens, or the caller closing the
        generator at EOS or a stop string), so the stored entry covers the whole reply and the
        next turn starts after it. Not when should_stop() ended the request (the client left)."""
        token, self.pending = self.pending, None
        if token is None or self.broken or not self.engine.store.budget or self.should_stop():
            return
        try:
            self._forward([token])
        except Exception:  # the entry is then discarded (self.broken); the reply was sent
            log.exception("feeding the last generated token failed; not caching this request")
            return
        self.fed.append(token)

    def commit(self) -> None:
        """Store what the KV state holds (end-of-generation checkpoint), the last yielded token
        fed first unless should_stop() ended the request; drop it if the state is unknown."""
        e = self.engine
        if self.entry is None:
            return
        self._feed_pending()
        if self.broken or (self.pos == self.start and not self.fed):
            # Unknown state, or nothing the store does not already hold.
            e.store.discard(self.entry)
            return
        tokens = self.prompt[:self.pos] + self.fed
        e.store.finish(self.entry, tokens, self.cache, snapshot.nbytes(self.cache),
                       snapshot.trimmable(self.cache), e._end_snapshot)
