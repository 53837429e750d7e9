"""Start-up probes of a model for the Engine: which KV quantization its attention accepts,
whether checkpoints can be taken inside prefill passes (`tap.verify`), how big its checkpoints
get, what a forward pass costs, and the in-message checkpoint interval chosen from those
(`IntervalChoice`). Runs once per model load, on the generation thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.cache.placement import auto_interval, compute_interval
from prefixd.backends.mlx.engine.inpass import tap

log = logging.getLogger("prefixd.worker.cache")
PROBE_TOKENS = 256  # the longer pass of the cost probe (or prefill_chunk if smaller)
PROBE_REPEATS = 3


def kv_quantization(model: Any, bits: int | None) -> tuple[int, int] | None:
    """(bits, group_size) that this model's attention accepts, or None (full precision)."""
    if not bits:
        return None
    for group in (64, 32):
        cache = snapshot.quantize_kv(make_prompt_cache(model), bits, group)
        try:
            mx.eval(model(mx.array([[0]]), cache=cache))
        except Exception as exc:  # mlx raises plain ValueError/RuntimeError here
            log.debug("kv_bits=%d group %d rejected: %s", bits, group, exc)
            continue
        return bits, group
    log.warning("kv_bits=%d is not supported by this model; keeping the KV cache in full "
                "precision", bits)
    return None


@dataclass(frozen=True)
class IntervalChoice:
    """The automatic interval and what it was sized from."""

    interval: int
    checkpoint_bytes: int  # the largest checkpoint the model can produce (estimate)
    by_bytes: int  # the interval whose checkpoints fit the budget share
    by_compute: int  # the interval whose extra forward passes stay under PASS_SHARE
    pass_ms: float  # fixed cost of one forward pass (a 1-token pass)
    token_ms: float  # cost per prompt token in a long pass

    def info(self) -> dict[str, Any]:
        return {"by_bytes": self.by_bytes, "by_compute": self.by_compute,
                "pass_ms": self.pass_ms, "token_ms": self.token_ms}


def _best_time(run: Callable[[], None]) -> float:
    best = math.inf
    for _ in range(PROBE_REPEATS):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def pass_costs(model: Any, fresh: Callable[[], list[Any]], chunk: int) -> tuple[float, float]:
    """(seconds of a 1-token forward pass, seconds per token of a `chunk`-token pass), each the
    best of a few runs on a fresh cache."""
    n = max(2, min(PROBE_TOKENS, chunk))

    def forward(tokens: int) -> Callable[[], None]:
        def run() -> None:
            cache = fresh()
            model(mx.zeros((1, tokens), dtype=mx.int32), cache=cache)
            snapshot.evaluate(cache)
        return run

    forward(n)()  # warm-up: kernels compiled, buffers allocated
    one, many = _best_time(forward(1)), _best_time(forward(n))
    return one, max(many - one, 1e-9) / (n - 1)


def choose_interval(model: Any, fresh: Callable[[], list[Any]], snap_idx: tuple[int, ...],
                    cache_bytes: int, chunk: int, by_cost: bool = False) -> IntervalChoice:
    """The in-message checkpoint interval for a model whose checkpoints hold `snap_idx`: the
    one whose checkpoints of a 32K-token conversation fit a quarter of the budget
    (`auto_interval`); with `by_cost`, the larger of that and the one whose extra forward
    passes cost at most 2% of the prefill (`compute_interval`: a small model pays a large
    fixed cost per pass for little work). Both are measured and reported either way."""
    probe = fresh()
    mx.eval(model(mx.array([[0]]), cache=probe))
    snapshot.evaluate(probe)
    size = snapshot.checkpoint_bytes(probe, snap_idx, chunk)
    pass_s, token_s = pass_costs(model, fresh, chunk)
    by_bytes, by_compute = auto_interval(size, cache_bytes), compute_interval(pass_s, token_s)
    chosen = max(by_bytes, by_compute) if by_cost else by_bytes
    choice = IntervalChoice(chosen, size, by_bytes, by_compute,
                            pass_s * 1000, token_s * 1000)
    log.info("checkpoint interval %d tokens (auto: %.3g MiB per checkpoint, budget %.3g GiB -> "
             "%d; a forward pass costs %.2f ms + %.3f ms/token -> %d)", choice.interval,
             size / 2**20, cache_bytes / 2**30, by_bytes, choice.pass_ms, choice.token_ms,
             by_compute)
    return choice


def inpass_leaves(model: Any, fresh: Callable[[], list[Any]], snap_idx: tuple[int, ...],
                  enabled: bool) -> tuple[int, ...] | None:
    """The snapshotted leaves, when checkpoints can be taken inside prefill passes for this
    model (`tap.verify`), else None: every checkpoint then cuts its pass."""
    if not snap_idx or not enabled:
        return None
    why = tap.verify(model, fresh, snap_idx)
    if why:
        log.info("checkpoints cut prefill passes for this model (in-pass capture: %s)", why)
        return None
    log.info("checkpoints are taken inside prefill passes (no extra forward passes)")
    return snap_idx


def pick_interval(model: Any, fresh: Callable[[], list[Any]], snap_idx: tuple[int, ...], *,
                  fixed: int | None, budget: int, chunk: int,
                  by_cost: bool) -> tuple[int, IntervalChoice | None]:
    """The in-message checkpoint interval: `fixed` if set, else sized to the model
    (`choose_interval`); with the choice, when one was probed."""
    if fixed is not None:
        return fixed, None
    if not snap_idx or not budget:
        return auto_interval(0, budget), None  # no checkpoints are ever stored
    choice = choose_interval(model, fresh, snap_idx, budget, chunk, by_cost)
    return choice.interval, choice


def group_interval(model: Any, fresh: Callable[[], list[Any]], snap_idx: tuple[int, ...], *,
                   fixed: int | None, budget: int, chunk: int, lockstep: Any) -> int:
    """A group worker's interval (`group/lockstep.py`): the same on every rank, with the same
    forward pass on each whatever its layers, and no timing: by bytes, from the rank whose
    checkpoint is largest."""
    if fixed is not None:
        return fixed
    probe = fresh()
    mx.eval(model(mx.array([[0]]), cache=probe))
    snapshot.evaluate(probe)
    size = lockstep.max(snapshot.checkpoint_bytes(probe, snap_idx, chunk) if snap_idx else 0)
    return auto_interval(size, budget)


def group_inpass(model: Any, fresh: Callable[[], list[Any]], snap_idx: tuple[int, ...],
                 enabled: bool, lockstep: Any) -> tuple[int, ...] | None:
    """`inpass_leaves` for a group: the same probe passes on every rank, and in-pass capture
    on every rank or none (a rank with nothing to snapshot gets `()`: its passes are not cut
    either)."""
    if not enabled:
        return None
    why = tap.verify(model, fresh, snap_idx, every_pass=True)
    if not lockstep.all(why is None):
        log.info("checkpoints cut prefill passes in this group (in-pass capture: %s)",
                 why or "refused on another rank")
        return None
    return snap_idx
