"""What speculative decoding holds on a hybrid with real Gated-DeltaNet widths: MLX memory held
between decode steps and peaked during them, speculation off, on with every drafted position's
state kept, and on with states computed again where needed (`spec_capture_bytes` 0,
`engine/inpass/captured.py`). In-process, random weights: a qwen3_next with Qwen3-Next's linear-
attention widths (32 value heads, 16 key heads, 128 x 128; `--layers`, 3 of every 4 linear),
narrow elsewhere; its output restricted to 4 tokens and drafts forced to `--draft` tokens each
step (the cost of replaying is largest when drafts are rejected early, as here). Stock mlx-lm
does not speculate on this model at all ("requires a trimmable prompt cache").

    ./run bench spec_memory                     # 8 layers, 8-token drafts: ~1 min
    ./run bench spec_memory --layers 16 --draft 8
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from typing import Any

import mlx.core as mx

from prefixd.backends.mlx.engine.config import EngineConfig
from prefixd.backends.mlx.engine.engine import Engine, Turn
from prefixd.backends.mlx.engine.pacing import Pacing
from prefixd.backends.mlx.engine.spec import draft
from prefixd.backends.mlx.model.tiny import model_from_config, restrict_output, tiny_config

WORDS = [5, 6, 7, 8]


def _model(layers: int) -> Any:
    model = model_from_config({
        **tiny_config("qwen3_next"), "hidden_size": 1024, "num_hidden_layers": layers,
        "linear_num_value_heads": 32, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "intermediate_size": 256, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64})
    restrict_output(model, WORDS)
    return model


def _run(model: Any, config: EngineConfig, prompt: list[int], tokens: int) -> dict[str, Any]:
    engine = Engine(model, config)

    def steps(p: list[int], n: int, turn: Any) -> Any:
        for step in engine.steps(p, sampler=lambda lp: mx.argmax(lp, axis=-1),
                                 logits_processors=None, max_tokens=n, boundaries=(),
                                 should_stop=lambda: False, namespace="", turn=turn):
            if isinstance(step, int):
                yield step

    list(steps(prompt[:20], 4, Turn(Pacing(config.prefill_chunk))))   # warm-up
    turn = Turn(Pacing(config.prefill_chunk))
    gen = steps(prompt, tokens, turn)
    out = [next(gen)]
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    base, held, t0 = mx.get_active_memory(), 0, time.perf_counter()
    for token in gen:
        out.append(token)
        held = max(held, mx.get_active_memory() - base)
    seconds = time.perf_counter() - t0
    spec = dict(turn.stats.speculative or {}) if turn.stats else {}
    return {"held": held, "peak": mx.get_peak_memory() - base, "seconds": seconds,
            "tokens": out, "spec": spec}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--draft", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    draft.Pace.length = lambda self, reach, rows=1: self.max_draft   # type: ignore[method-assign]
    model = _model(args.layers)
    linear = args.layers - args.layers // 4
    state = linear * 32 * 128 * 128 * 4
    rng = random.Random(1)
    prompt = [rng.choice(WORDS) for _ in range(30)] * 4
    rows = []
    for name, spec, capture in (("off", False, 0), ("kept", True, 1 << 40),
                                ("replayed", True, 0)):
        config = EngineConfig(cache_bytes=1 << 20, speculative=spec, spec_capture_bytes=capture,
                              spec_draft_max=args.draft)
        rows.append((name, _run(model, config, prompt, args.tokens)))
    mib = 2**20
    print(f"qwen3_next, {args.layers} layers ({linear} Gated-DeltaNet: {state / mib:.0f} MiB of "
          f"recurrent state a request), drafts of {args.draft}, {args.tokens} tokens\n")
    print("| speculation | held between steps MiB | peak during decode MiB | decode s | "
          "drafted / accepted | reply = off |")
    print("|---|---|---|---|---|---|")
    want = rows[0][1]["tokens"]
    for name, r in rows:
        s = r["spec"]
        print(f"| {name} | {r['held'] / mib:.1f} | {r['peak'] / mib:.1f} | {r['seconds']:.2f} | "
              f"{s.get('drafted', 0)} / {s.get('accepted', 0)} | {r['tokens'] == want} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
