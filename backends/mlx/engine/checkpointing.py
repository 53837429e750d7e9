"""Taking checkpoints during a prefill and committing what a request leaves: the part of the
Engine (`engine/engine.py`, a mixin of it) that turns the live cache into store entries and
checkpoints, at the positions `placement.prefill_plan` gives. In a group worker every size and
trimmability it stores is the ranks' agreed one (`group/lockstep.py`), so every rank's store decides
alike. Called on the generation thread only, like the rest of the Engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.cache.placement import prefill_plan
from prefixd.backends.mlx.cache.store import Entry
from prefixd.backends.mlx.engine.run import LOST, Run
from prefixd.backends.mlx.engine.stats import PromptStats

if TYPE_CHECKING:
    from prefixd.backends.mlx.cache.store import CheckpointStore
    from prefixd.backends.mlx.engine.counts import CacheCounts
    from prefixd.backends.mlx.engine.tierglue import TierGlue
    from prefixd.backends.mlx.group.lockstep import Lockstep

log = logging.getLogger("prefixd.worker.cache")


class Checkpointing:
    """The Engine's checkpoints and commits (its state: the Engine's own)."""

    store: CheckpointStore
    lockstep: Lockstep
    counts: CacheCounts
    tiers: TierGlue
    interval: int
    config: Any
    _snap_idx: tuple[int, ...]
    _checkpoints: bool
    _trim_below: int
    _unsupported: str | None
    adopt: Callable[[list[int], list[Any], str], int]   # the Engine's

    def _plan(self, n: int, start: int, boundaries: Sequence[int]) -> tuple[dict[int, bool], int]:
        """`placement.prefill_plan`. All-KV models take no checkpoints (the entry's KV trims
        to any prefix): their prefill is cut only by `prefill_chunk`."""
        if not self._checkpoints:
            return {}, n - 1
        return prefill_plan(n, start, boundaries, self.interval, self.config.checkpoint_tail,
                            trim_below=self._trim_below)

    def _capture(self, entry: Entry | None, run: Run, pos: int, interval: bool,
                 stats: PromptStats, payload: snapshot.Snapshot | None = None) -> None:
        """Checkpoint at `pos`: `payload` (taken inside the pass), else the live cache, which is
        at `pos` (its row of a decode batch, when a decode pass fed its prompt's last token).
        A failure costs the checkpoint, not the reply."""
        if entry is None or self.lockstep.any(payload is LOST):   # lost in the pass (a rank's)
            return
        t0 = time.perf_counter()
        try:
            if payload is None and run.batch is not None:
                payload = run.batch.leaves_of(run, self._snap_idx)
                size = snapshot.payload_bytes(payload)
            elif payload is None:
                payload, size = snapshot.take(run.cache, self._snap_idx)
            else:
                size = snapshot.payload_bytes(payload)
            size = self.lockstep.max(size)    # a group budgets its largest rank's bytes
            if self.store.add_checkpoint(
                    entry, pos, payload, size, interval=interval,
                    trimmable=self.lockstep.all(snapshot.snapshot_trimmable(payload))):
                stats.checkpoints += 1
                stats.checkpoint_bytes += size
        except Exception:
            self.lockstep.local_failure()     # a group's stores would part: it raises
            log.exception("checkpoint at %d failed; continuing without it", pos)
            self.counts.fallback("checkpoint_error")
        stats.checkpoint_s += time.perf_counter() - t0

    def _capture_restored(self, entry: Entry, cache: list[Any], pos: int) -> None:
        """Keep the state loaded from disk in RAM too (as a checkpoint of the new entry)."""
        if self._checkpoints:
            payload, size = snapshot.take(cache, self._snap_idx)
            self.store.add_checkpoint(
                entry, pos, payload, self.lockstep.max(size),
                trimmable=self.lockstep.all(snapshot.snapshot_trimmable(payload)))

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
            snapshot.trim_padding(run.cache)     # stored (and budgeted) without spare capacity
            if self.store.finish(entry, run.tokens, run.cache,
                                 self.lockstep.max(snapshot.nbytes(run.cache)),
                                 self.lockstep.all(snapshot.trimmable(run.cache)),
                                 self._end_snapshot):
                self.tiers.committed(entry)
        except Exception:
            self.lockstep.local_failure()     # a group's stores would part: it raises
            log.exception("storing this request's prompt cache failed; the reply is unaffected")
            self.counts.fallback("commit_error")
            self.store.discard(entry)

    def _publish(self, tokens: list[int], cache: list[Any], namespace: str) -> None:
        """A prefix other requests wait for (the scheduler's `share`), stored the moment it is
        computed, from a copy of the live cache (which goes on): they restore it instead of
        computing it beside this one. Never raises (a failure: they compute it themselves)."""
        if self._unsupported:
            return
        try:
            copy = snapshot.rebuild(cache, [snapshot.copy_leaf(leaf)
                                            for leaf in snapshot.leaves(cache)])
            snapshot.trim_padding(copy)
            self.adopt(tokens, copy, namespace)
        except Exception:
            log.exception("storing a shared prefix of %d tokens failed", len(tokens))
            self.lockstep.local_failure()

    def publish_live(self, run: Run | None, entry: Entry | None, at: int,
                     namespace: str) -> int:
        """A prefix of a running request's prompt that other requests wait for, stored from its
        live state after its prefill went past it (`_publish` stores one the moment a pass ends
        there): at `at` where every layer trims back, else at the request's own checkpoint
        nearest below `at` (its recurrent and window layers from that checkpoint, the rest
        trimmed from the live cache). Decoding in a batch, its row is copied out (it stays).
        The tokens stored (0: none). Never raises."""
        if self._unsupported or run is None or entry is None or run.broken or run.pos < at:
            return 0
        try:
            live = run.cache if run.batch is None else run.batch.row(run)
            pos, snap = at, None
            if not self.lockstep.all(snapshot.trimmable(live)):
                below = [p for p in entry.checkpoints if p <= at]
                pos = max(below, default=0)
                if not pos:
                    return 0
                snap = entry.checkpoints[pos].payload
            held = self.store.peek([*run.prompt[:pos], -1], namespace)
            if held is not None and held.pos >= pos:   # the store holds it already
                return 0
            cache = snapshot.restore(live, snap, pos)
            del live
            snapshot.trim_padding(cache)
            return self.adopt(run.prompt[:pos], cache, namespace)
        except Exception:
            log.exception("storing a shared prefix of %d tokens from a running request failed",
                          at)
            self.lockstep.local_failure()
            return 0

    def _end_snapshot(self, entry: Entry) -> tuple[Any, int, bool] | None:
        if not self._checkpoints:
            return None
        payload, size = snapshot.take(entry.payload, self._snap_idx)
        trimmable = self.lockstep.all(snapshot.snapshot_trimmable(payload))
        return payload, self.lockstep.max(size), trimmable

