"""The generation engine of the mlx worker: restore the longest cached prefix, prefill the rest
with checkpoints, decode, and commit what the KV state holds back to the checkpoint store.

Owns: the prefill/decode loop (so prefill chunks can end exactly at checkpoint positions), the
restore decision and its fallbacks, taking checkpoints and the commit at the end of a request
(`engine/checkpointing.py`, a mixin), per-request `PromptStats`, and the face other workers' states
come in and go out through (`engine/transfer/bundle.py`). What this model's cache supports is
probed at start (`engine/probe.py`); the counts and cache metrics are `engine/counts.py`; policy
(placement, lookup, budget) lives in `cache/placement.py` and `cache/store.py`; per-class cache
handling in `cache/snapshot.py`; the disk tier behind `engine/tierglue.py`. Called from one thread
only (the worker's single-thread executor), so nothing here locks. In a group worker every rank
runs the same Engine calls in lockstep on its own layers; the values a rank computes from its
layers alone (sizes, trimmability, whether a restore worked, what the start-up probes found) go
through the `lockstep` (`group/lockstep.py`) so every rank's store decides as the leader's, and the
prefill passes have the same shapes on every rank. The Engine never asks which rank it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.cache.store import CheckpointStore
from prefixd.backends.mlx.engine import probe
from prefixd.backends.mlx.engine.batch import launch, prefill
from prefixd.backends.mlx.engine.batch.executor import Batch
from prefixd.backends.mlx.engine.batch.passes import PassCounts
from prefixd.backends.mlx.engine.batch.stacking import unbatchable
from prefixd.backends.mlx.engine.checkpointing import Checkpointing
from prefixd.backends.mlx.engine.config import EngineConfig
from prefixd.backends.mlx.engine.counts import CacheCounts
from prefixd.backends.mlx.engine.pacing import Pacing, Plan, Sent, resume
from prefixd.backends.mlx.engine.restoring import Restoring
from prefixd.backends.mlx.engine.run import Run, Step
from prefixd.backends.mlx.engine.spec.config import spec_config, spec_info
from prefixd.backends.mlx.engine.spec.speculate import Speculation
from prefixd.backends.mlx.engine.stats import PromptStats
from prefixd.backends.mlx.engine.tierglue import DiskSpec, TierGlue
from prefixd.backends.mlx.group.lockstep import Lockstep

if TYPE_CHECKING:
    import mlx.nn as nn

    from prefixd.backends.mlx.cache.store import Entry


log = logging.getLogger("prefixd.worker.cache")



@dataclass(eq=False)
class Turn:
    """One request's own view of the Engine (several may be under way: `scheduler/`): its
    pacing (whether a pass under way pauses, whether a first pass is taken back: fixed for the
    turn; each pass's size goes in with its step, `pacing.Plan`), its stats and store entry
    (set when it starts) and its live state."""

    pacing: Pacing
    stats: PromptStats | None = None
    entry: Entry | None = None
    run: Run | None = None


class Engine(Restoring, Checkpointing):
    """One model, one checkpoint store, one generation at a time."""

    def __init__(self, model: nn.Module, config: EngineConfig,
                 disk: DiskSpec | None = None, model_id: str | None = None,
                 lockstep: Lockstep | None = None, draft_model: Any = None,
                 mtp: Any = None, refused: dict[str, dict[str, str]] | None = None) -> None:
        self.model = model
        # drafters asked for but not used, each named with why (`loading.refusals`)
        self.refused = refused or {}
        self.config = config
        self.lockstep = lockstep = lockstep or Lockstep()
        # what identifies the model's weights (`tierglue.model_fingerprint`): states move
        # only between workers of the same one (`engine/transfer/bundle.py`)
        self.model_id = model_id or (disk.model_id if disk else None)
        self._reference: list[Any] | None = None
        self.logits_bytes = 0   # one position's logits (`reference_leaves`)
        self.store = CheckpointStore(config.cache_bytes)
        self.counts = CacheCounts()
        self._kv = probe.kv_quantization(model, config.kv_bits)
        if config.kv_bits and not self._kv:
            self.counts.fallback("kv_quant_unsupported")
        template = self.fresh_cache()
        self._unsupported = snapshot.unsupported(template)
        if lockstep.any(bool(self._unsupported)) and not self._unsupported:
            self._unsupported = "another rank of the group holds a cache it cannot snapshot"
        if self._unsupported:
            log.warning("prompt cache disabled for this model: %s; every prompt is prefilled "
                        "cold", self._unsupported)
        self._snap_idx = () if self._unsupported else snapshot.snapshot_indices(template)
        # checkpoints are taken (at the same positions on every rank of a group)
        self._checkpoints = lockstep.any(bool(self._snap_idx))
        # Windows as the only snapshotted layers: a checkpoint below the window trims back.
        self._trim_below = lockstep.min(snapshot.trimmable_below(template, self._snap_idx))
        if lockstep.untimed:   # no timed probes: the same passes on every rank
            self.inpass = probe.group_inpass(model, self.fresh_cache, self._snap_idx,
                                             config.checkpoint_inpass, lockstep)
            self.interval_choice = None
            self.interval = probe.group_interval(
                model, self.fresh_cache, self._snap_idx, fixed=config.checkpoint_interval,
                budget=config.cache_bytes, chunk=config.prefill_chunk, lockstep=lockstep)
            self.reference_leaves()
        else:
            self.inpass = probe.inpass_leaves(model, self.fresh_cache, self._snap_idx,
                                              config.checkpoint_inpass)
            self.interval, self.interval_choice = probe.pick_interval(
                model, self.fresh_cache, self._snap_idx, fixed=config.checkpoint_interval,
                budget=config.cache_bytes, chunk=config.prefill_chunk,
                by_cost=config.checkpoint_interval_policy == "cost" and self.inpass is None)
        # estimated size of one checkpoint
        self.checkpoint_bytes = (self.interval_choice.checkpoint_bytes if self.interval_choice
                                 else None)
        # decode steps of the running requests share one forward pass (`engine/batch/executor.py`)
        self.passes = PassCounts()
        self.batch = Batch(model, self.passes)
        # a group's ranks launch nothing ahead (they would have to agree on every such pass)
        self.batch.ahead = launch.Worth(config.decode_ahead if not lockstep.untimed else "off")
        self.unbatchable = unbatchable(template)
        # newcomers' prompts share a prefill pass (`engine/batch/prefill.py`)
        self.prefills_together = prefill.possible(template) and not self.unbatchable
        if self.unbatchable:
            log.warning("decode steps run one request at a time: %s", self.unbatchable)
        # speculative decoding (`engine/spec/speculate.py`): a verify pass goes back exactly
        self.spec, self.unspeculative = spec_config(
            config, self._snap_idx, self.inpass, self._unsupported, not lockstep.untimed,
            draft_model, lambda: probe.inpass_leaves(model, self.fresh_cache, self._snap_idx,
                                                     True), mtp)
        # RAM first, disk second (disk only when `disk` is given and the cache is supported)
        self.tiers = TierGlue(self.store, template, None if self._unsupported else disk,
                              self._snap_idx, config, lockstep)
        self.counts.budget(config.cache_bytes)
        self.counts.gauges(self.store)

    @property
    def fallbacks(self) -> dict[str, int]:
        """How often each fallback happened since start, by reason."""
        return self.counts.fallbacks

    # --- setup -------------------------------------------------------------------------------
    def fresh_cache(self) -> list[Any]:
        """An empty live cache of this engine's kind (KV quantized if configured)."""
        cache = make_prompt_cache(self.model)
        return snapshot.quantize_kv(cache, *self._kv) if self._kv else cache

    # --- generation --------------------------------------------------------------------------
    def begin(self, prompt: list[int], *, sampler: Callable[[mx.array], mx.array],
              logits_processors: list | None = None, max_tokens: int,
              should_stop: Callable[[], bool] = lambda: False, namespace: str = "",
              turn: Turn) -> Run:
        """Restore the longest prefix of `prompt` the request's cache partition (`namespace`:
        per-key isolation) holds, open its store entry, and build its live state (`turn.run`,
        with its stats from its start in `turn.stats`): no forward pass runs."""
        if not prompt:
            raise ValueError("empty prompt")
        prompt = list(prompt)
        stats = turn.stats = PromptStats(len(prompt))
        cache, start = self._restore(prompt, stats, namespace=namespace)
        entry = turn.entry = None if self._unsupported else self.store.begin(prompt, namespace)
        if entry is not None and stats.tier == "disk":
            self._capture_restored(entry, cache, start)
        run = turn.run = Run(self.model, cache, prompt, start, turn.pacing, should_stop,
                             self.inpass, self.passes,
                             lambda pos: self._publish(prompt[:pos], run.cache, namespace))
        run.max_tokens, run.sampler = max_tokens, sampler
        run.processors = logits_processors or []
        if self.spec is not None:
            run.spec = Speculation(self.spec, prompt, max_tokens)
        return run   # its cache is the run's alone: a decode batch takes it over

    def steps_of(self, turn: Turn, boundaries: Sequence[int], plan: Plan
                 ) -> Generator[Step, Sent, None]:
        """The forward passes of a turn `begin` began, one per step (`run.Step`): `Prefilled`
        after each prefill pass but the last (checkpoints taken at the plan's marks), `Paused`
        inside one, `Ready` before its prompt's last token, then the token of each decode step,
        up to `max_tokens`. Each pass's size is `plan`'s, or that of the `Plan` sent in since.
        Stops early when `should_stop()` is true between passes. `turn.stats` gets the cached
        and recomputed tokens once the prefill ended. The restore and the commit are not
        steps: its caller calls `end` once they are over, on any exit (the generator ended,
        closed or failed)."""
        run, stats, entry = turn.run, turn.stats, turn.entry
        assert run is not None and stats is not None

        def capture(pos: int, interval: bool, payload: snapshot.Snapshot | None) -> None:
            self._capture(entry, run, pos, interval, stats, payload)

        # the prefill's own time: not the passes of other jobs run while it was paused (the
        # prefill rate it feeds decides whether a disk load beats recomputing)
        prefill_s, t0 = 0.0, time.perf_counter()
        passes = run.prefill_passes(*self._plan(len(run.prompt), run.start, boundaries),
                                    capture, plan)
        sent: Sent = None
        while (step := resume(passes, sent)) is not None:
            prefill_s += time.perf_counter() - t0
            sent = yield step
            t0 = time.perf_counter()
        prefill_s += time.perf_counter() - t0
        stats.prefill_s, stats.segments, stats.yields = prefill_s, run.segments, run.yields
        if self.lockstep.any(bool(run.tap_failure)) and not run.tap_failure:
            run.tap_failure = "on another rank of the group"
        if run.tap_failure:  # its inner checkpoints are lost; later requests cut passes
            log.warning("in-pass checkpoints failed (%s); cutting prefill passes at "
                        "checkpoints from now on", run.tap_failure)
            self.counts.fallback("inpass_error")
            self.inpass = None
        self.counts.request(stats, run.start, run.pos - run.start)
        self.tiers.prefilled(stats)
        if run.opening is not None:
            yield from run.decode(run.opening, stats)

    def prefill_together(self, runs: list[Run],
                         regroup: Callable[[], int] | None = None) -> list[Run] | None:
        """The prompts of `runs` past what each restored, all but their last token, in one
        pass (`engine/batch/prefill.py`, at most `prefill.MOST`), each run then `Ready`; the
        others prefill in passes of their own. The runs that shared it; None where it was
        taken back for jobs that arrived meanwhile (`regroup`, asked only where none of them
        was taken back before, `Run.regrouped`: each row at most once). Raises what the model
        raises (those runs are `broken`)."""
        rows = [r for r in runs if prefill.takes(r)][:prefill.MOST]
        if not self.prefills_together or len(rows) < 2:
            return []
        todo = [len(r.prompt) - 1 - r.pos for r in rows]
        asked = regroup is not None and not any(r.regrouped for r in rows)
        for r in rows:
            r.regrouped = r.regrouped or asked
        seconds = prefill.together(self.model, rows, self.passes, regroup if asked else None)
        if seconds is None:
            return None
        for r, n in zip(rows, todo, strict=True):   # its share, as the prefill rate sees it
            r.segments.append((n, seconds * n / sum(todo)))
        return rows

    def end(self, turn: Turn) -> None:
        """Commit what a turn's live state holds and let go of it (once; its passes are over).
        On a normal end (max_tokens, EOS, a stop string) the last token is fed through the
        model once more first, so the KV covers prompt + every generated token; not when
        `should_stop()` ended it (the client left), nor when it ends in a decode batch beside
        others (they would wait through that pass). Never raises."""
        run, stats = turn.run, turn.stats
        if run is None or stats is None or run.ended:
            return
        run.ended = True
        t0 = time.perf_counter()
        # ending in company, its last token is not fed in a pass of its own that the requests
        # still decoding would wait through: its entry ends before it (the next turn
        # prefills one token more)
        if any(r is not run for r in self.batch.runs):
            run.feed_last = False
        try:
            run.settle()          # its own cache back out of a decode batch
        except Exception:
            log.exception("taking a request's cache out of its decode batch failed")
            run.broken = True
        self._commit(turn.entry, run)
        self.counts.gauges(self.store)
        stats.commit_s = time.perf_counter() - t0
        if run.spec is not None:
            stats.speculative = run.spec.info()
        run.release()

    def cache_info(self) -> dict:
        """JSON for GET /v1/cache."""
        info = self.store.info()
        return {
            **info,
            **self.counts.info(info),
            "disabled_reason": self._unsupported,
            "kv_bits": self._kv[0] if self._kv else None,
            "checkpoint_interval": self.interval,  # effective (the setting may be auto)
            "checkpoint_bytes_estimate": self.checkpoint_bytes,
            "checkpoint_interval_auto": (self.interval_choice.info() if self.interval_choice
                                         else None),
            "settings": {k: v for k, v in asdict(self.config).items() if k != "kv_bits"},
            "disk": self.tiers.info(),
            "misses": self.tiers.misses(),
            "batch": {**self.passes.info(), "disabled_reason": self.unbatchable},
            "speculative": {**self.passes.spec_info(),
                            **spec_info(self.spec, self.unspeculative, self.refused)},
        }

    # --- the disk tier (generation thread) ----------------------------------------------------
    def next_write_due(self) -> float | None:
        """When (time.monotonic) the next idle entry is due to be written, if any."""
        return self.tiers.next_due()

    def due_writes(self, at: float | None = None) -> list[int]:
        """The store positions of the entries due to be written at `at` (None: now; a group's
        leader journals them, and every rank then `write`s them)."""
        return self.tiers.due(at)

    def write(self, positions: list[int]) -> int:
        return self.tiers.flush(positions)

    def persist(self) -> None:
        """Submit everything not yet on disk (at shutdown); `close` waits for it."""
        self.tiers.flush_all()

    def close(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) for pending disk writes, then stop the writer."""
        return self.tiers.close(timeout)
