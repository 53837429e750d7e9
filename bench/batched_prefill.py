"""Whether several short prompts should share a prefill pass: N prompts prefilled one pass
each (prefixd's way) against one pass of all N, left-padded (stock mlx-lm's batched prefill),
in-process on one model, alternated, the median of `--repeats`.

    ./run bench batched_prefill                      # the built-in model (float32), N = 2, 4, 8
    ./run bench batched_prefill --model PATH --lengths 64,256

Prints seconds per prompt token both ways; the ratio is what sharing a pass would save (or
cost) on this device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interactive import builtin_f32

from prefixd.backends.mlx.model.provision import load_model


def one_each(model, prompts: list[list[int]]) -> float:
    t0 = time.perf_counter()
    for p in prompts:
        cache = make_prompt_cache(model)
        model(mx.array(p)[None], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


def together(model, prompts: list[list[int]]) -> float:
    t0 = time.perf_counter()
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    tokens = mx.array([[0] * pad + p for p, pad in zip(prompts, pads, strict=True)])
    cache = [BatchKVCache(pads) for _ in model.layers]
    model(tokens, cache=cache)
    mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--ns", default="2,4,8")
    ap.add_argument("--lengths", default="32,128,512")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.model is None:
        args.out = Path(__file__).resolve().parent / "out"
        args.models_dir = args.out / "models"
        args.cache_dir = Path(os.environ.get("PREFIXD_CACHE_DIR", "~/.cache/prefixd")).expanduser()
        args.model = builtin_f32(args)
    model, _ = load_model(str(args.model), None, dequantize=False)
    vocab = model.args.vocab_size
    print(f"model {args.model.name}; seconds per prompt token, median of {args.repeats}")
    print("| N | prompt tokens | one pass each ms | one pass of all ms | all / each |")
    print("|---|---|---|---|---|")
    for n in [int(x) for x in args.ns.split(",")]:
        for length in [int(x) for x in args.lengths.split(",")]:
            prompts = [[(i * 7919 + j * 31) % (vocab - 1) + 1 for j in range(length - i)]
                       for i in range(n)]
            one_each(model, prompts[:1])   # warm-up
            together(model, prompts[:2])
            each, all_ = [], []
            for _ in range(args.repeats):
                each.append(one_each(model, prompts))
                all_.append(together(model, prompts))
            e, a = statistics.median(each), statistics.median(all_)
            print(f"| {n} | {length} | {e * 1000:.0f} | {a * 1000:.0f} | {a / e:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
