"""In-process A/B of one warm append-only turn: checkpoints taken inside the prefill pass
(`PREFIXD_CHECKPOINT_INPASS`, the default) against checkpoints that cut the pass, and against
no checkpoints at all, on the same tiny model, alternating, many trials. It isolates what the
checkpoints cost the prefill from the HTTP, tokenizing and scheduling noise of `bench/ttft.py`.

    ./run bench inpass                     # qwen3_next, gemma3_text, falcon_h1; 30 trials
    ./run bench inpass --models qwen3_next --trials 50 --per-turn 260 --interval 64

Prints per model the prefill time (min and median ms over the trials), passes and checkpoints
of the warm turn for each variant.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

import mlx.core as mx

from prefixd.backends.mlx.engine.engine import Engine, EngineConfig, Turn
from prefixd.backends.mlx.engine.pacing import Pacing
from prefixd.backends.mlx.model.tiny import build_model

VARIANTS = {
    "in-pass": {"checkpoint_inpass": True},
    "cut passes": {"checkpoint_inpass": False},
    "no checkpoints": {"checkpoint_inpass": True, "checkpoint_interval": 1 << 20},
}


def _greedy(lp: mx.array) -> mx.array:
    return mx.argmax(lp, axis=-1)


def trial(engine: Engine, base: list[int], turn: list[int], bounds: list[int]) -> tuple:
    """Turn 1 (cold, stored), then the measured turn 2 that appends to it."""
    for prompt, marks in ((base, bounds[:2]), (turn, bounds)):   # as the worker runs a job
        request = Turn(Pacing(engine.config.prefill_chunk))
        for _ in engine.steps(prompt, sampler=_greedy, max_tokens=1, boundaries=marks,
                              turn=request):
            pass
    s = request.stats
    assert s is not None and s.cached_tokens >= len(base) - 1
    return s.prefill_s, len(s.segments), s.checkpoints


def bench(arch: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    model = build_model(arch, seed=1)
    engines = {name: Engine(model, EngineConfig(**{
        "cache_bytes": 2**30, "checkpoint_interval": args.interval, **kw}))
        for name, kw in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    shape: dict[str, tuple[int, int]] = {}
    for i in range(args.trials + 2):
        rng = random.Random(f"{arch}-{i}")  # a new conversation per trial: nothing is reused
        base = [rng.randrange(1, 1000) for _ in range(args.context)]
        turn = base + [rng.randrange(1, 1000) for _ in range(args.per_turn)]
        bounds = [3, len(base) // 2, len(base) + 5, len(turn) - 5]
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        for name in order:
            t, passes, checkpoints = trial(engines[name], base, turn, bounds)
            if i >= 2:  # two warm-up rounds
                times[name].append(t)
            shape[name] = (passes, checkpoints)
    return [{"model": arch, "variant": name, "min_ms": min(ts) * 1000,
             "median_ms": statistics.median(ts) * 1000, "passes": shape[name][0],
             "checkpoints": shape[name][1], "inpass": engines[name].inpass is not None}
            for name, ts in times.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3_next,gemma3_text,falcon_h1")
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--context", type=int, default=1300, help="tokens restored")
    p.add_argument("--per-turn", type=int, default=260, help="tokens the turn appends")
    p.add_argument("--interval", type=int, default=64, help="PREFIXD_CHECKPOINT_INTERVAL")
    args = p.parse_args(argv)
    print("| model | variant | prefill ms, min | median | passes | checkpoints |")
    print("|---|---|---|---|---|---|")
    for arch in args.models.split(","):
        t0 = time.monotonic()
        rows = bench(arch, args)
        for r in rows:
            print(f"| {r['model']} | {r['variant']} | {r['min_ms']:.1f} | {r['median_ms']:.1f} "
                  f"| {r['passes']} | {r['checkpoints']} |", flush=True)
        print(f"<!-- {arch}: {time.monotonic() - t0:.0f} s -->", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
