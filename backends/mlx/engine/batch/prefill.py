"""Several newcomers' prompts prefilled in one forward pass, as stock mlx-lm prefills a batch:
where the model's cache is full-attention KV alone (no checkpoints are taken inside a
prefill, `engine.Engine.prefills_together`).

Owns: nothing between calls; when a first prefill pass is taken back for company
(`regroups`, for a run's own pass, `engine/run.py`, and for a shared one). `together` takes
runs as they were restored (a follow-up turn from its conversation's stored prefix, a fresh
prompt from nothing), merges their caches into
mlx-lm's `BatchKVCache` (prefixes left-padded to the longest), feeds all but the last token of
each prompt past its prefix, right-padded to the longest, in one pass (its masks keep each row
to its own tokens, its offsets give each row its own positions; the right padding is rolled
into the left after the pass, as stock's `BatchGenerator.prompt` does), then extracts each
row into a cache of its own (`KVCache`, what a pass alone leaves, up to kernel rounding).
Each run's last prompt token then waits (`pacing.Ready`) for a decode pass to carry it
(`executor.Batch.step`). A pass may be taken back in its first layers for requests that
arrived during it (`regroups`; each run's cache is as it was: the pass wrote a merged
copy). Measured on the built-in model (2 CPU
cores, `bench/batched_prefill.py`): 4 prompts of 32 tokens in one pass take 0.62 of the time
of one pass each, of 128 tokens 0.80; 2 of 32, 0.78. A GPU, which short passes leave idler
than a CPU's cores, should gain more (stock mlx-lm batches up to 8 prompts on Metal).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.batch.passes import PassCounts

if TYPE_CHECKING:
    from prefixd.backends.mlx.engine.live.state import Live

MOST = 8   # prompts in one pass at most (stock mlx-lm's prefill batch)
REGROUP_SHARE = 0.5   # the layers of a first pass it may still be taken back in


def regroups(layers: int, evaluate: Callable[[int], None], regroup: Callable[[], int]) -> bool:
    """Whether a first prefill pass of `layers` layers, its own or shared, is taken back
    (`pacing.Regrouped`): asked as its 1st, 2nd, 4th, 8th ... layer is evaluated
    (`evaluate(i)`: the i-th, from 0), within its first `REGROUP_SHARE` of layers, it is
    taken back once the jobs arrived that would share it (`regroup()`, 0: none) stop growing
    in number from one ask to the next (a burst's requests arrive over some milliseconds:
    each is parsed, templated and tokenized in the worker's event loop), or at the last ask
    where some had."""
    layer, seen = 1, 0
    while layer <= max(1, layers * REGROUP_SHARE):
        evaluate(layer - 1)
        arrived = regroup()
        if arrived and arrived == seen:
            return True
        layer, seen = layer * 2, arrived
    return seen > 0


def possible(template: list[Any]) -> bool:
    """Whether prompts of this cache kind can share a prefill pass: every layer full-attention
    KV, unquantized (a window, a recurrent state or quantized KV would need its own batch
    form)."""
    return bool(template) and all(type(c) is KVCache for c in template)


def takes(run: Live) -> bool:
    """Whether `run` can be a row of a shared prefill pass: nothing generated yet, at least
    one prompt token to prefill besides its last (the decode pass's), its state known, its
    cache its own and full-attention KV (restored or empty)."""
    return not run.fed and run.pos < len(run.prompt) - 1 and not run.broken and \
        run.batch is None and all(type(c) is KVCache for c in run.cache)


def together(model: Any, runs: Sequence[Live], passes: PassCounts,
             regroup: Callable[[], int] | None = None) -> float | None:
    """All but the last token of each run's prompt past what it restored (`pos`), in one pass;
    each run's cache is then its own again, at `pos` = its prompt's length - 1. The seconds it
    took; None where `regroup` took the pass back in its first layers (`regroups`: jobs
    that arrived meanwhile share it; each run's cache is as it was, the merged copy
    dropped). Raises what the model raises (every run is then `broken`)."""
    prompts = [r.prompt[r.pos:-1] for r in runs]
    width = max(len(p) for p in prompts)
    right = [width - len(p) for p in prompts]
    t0 = time.perf_counter()
    for r in runs:
        r.broken = True
    # each layer: the rows' restored prefixes left-padded to the longest (empty: no rows yet)
    cache = [BatchKVCache.merge([r.cache[i] for r in runs]) for i in range(len(runs[0].cache))]
    if any(right):     # the rows' new tokens right-padded, the padding then rolled left
        for layer in cache:
            layer.prepare(right_padding=right)
    model(mx.array([p + [0] * pad for p, pad in zip(prompts, right, strict=True)]),
          cache=cache)
    if regroup is not None and _taken_back(cache, regroup):
        del cache
        mx.clear_cache()
        for r in runs:
            r.broken = False
        passes.regrouped += 1
        return None
    for layer in cache:
        layer.finalize()
    snapshot.evaluate(cache)
    for i, (r, p) in enumerate(zip(runs, prompts, strict=True)):
        r.cache = [layer.extract(i) for layer in cache]
        r.pos += len(p)
    snapshot.evaluate([layer for r in runs for layer in r.cache])
    del cache
    mx.clear_cache()     # the pass's activations: not kept for the decode passes after it
    for r in runs:
        r.broken = False
    seconds = time.perf_counter() - t0
    passes.together(len(runs), sum(len(p) for p in prompts))
    return seconds


def _taken_back(cache: list[BatchKVCache], regroup: Callable[[], int]) -> bool:
    """Whether the shared pass under way is taken back (`regroups`), a layer at a time
    evaluated while it is asked."""
    return regroups(len(cache), lambda i: mx.eval(cache[i].state), regroup)
