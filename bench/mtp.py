"""What drafting with a model's own multi-token-prediction head (`spec_mtp`) costs where the head
guesses badly, float and stored quantized: decode tok/s of four workers on one tiny qwen3_next
folder that ships a random head in `mtp.safetensors` (the head on; the same head's weights
stored quantized as a conversion stores them, in a copy of the folder; `spec_mtp` false;
speculation off), greedy, one request at a time, replies compared with speculation off.
In-process, no server (stock mlx-lm drops the head: it has nothing to compare). No checkpoint
with a trained head is available offline, so this measures the head's cost, not what a trained
one is worth.

    ./run bench mtp                  # prose-like (1,024-token vocabulary): ~1 min
    ./run bench mtp --words 3        # replies that repeat: prompt lookup drafts first
    ./run bench mtp --bits 8         # the head at 8 bits (default 4, groups of 64)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.model.mtp import MTP_FILE
from prefixd.backends.mlx.model.mtpquant import store_quantized
from prefixd.backends.mlx.model.tiny import save_tiny_model
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.scheduler.jobs import Finished
from prefixd.backends.mlx.scheduler.output import Delta
from prefixd.backends.mlx.settings import WorkerSettings

# name, folder (the float head's, or the copy with it quantized), settings
CONFIGS = (("head on", "float", {}), ("quantized head on", "quantized", {}),
           ("spec_mtp false", "float", {"spec_mtp": False}),
           ("speculation off", "float", {"speculative": False}))


async def _load(path: Path, extra: dict[str, Any]) -> Generator:
    gen = Generator(WorkerSettings(_env_file=None, disk_cache_bytes=0, **extra))
    await gen.load(str(path))
    return gen


async def _one(gen: Generator, prompt: list[int], tokens: int, ns: str) -> tuple[str, Finished]:
    job = gen.submit(Prompt(prompt, []), Sampling(temperature=0), tokens, logprobs=None,
                     namespace=ns)
    text: list[str] = []
    async for event in job.events():
        if isinstance(event, Delta):
            text.append(event.text)
        elif isinstance(event, Finished):
            return "".join(text), event
    raise RuntimeError("the job ended without finishing")


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="prefixd-mtp-"))
    folders = {"float": root / "model", "quantized": root / "quantized"}
    save_tiny_model("qwen3_next", folders["float"], words=args.words, mtp=True)
    shutil.copytree(folders["float"], folders["quantized"])
    done = store_quantized(folders["quantized"] / MTP_FILE, args.bits, args.group_size)
    print(f"head stored quantized: {done} matrices at {args.bits} bits, groups of "
          f"{args.group_size}")
    gens = {name: await _load(folders[kind], extra) for name, kind, extra in CONFIGS}
    for name, gen in gens.items():      # a head refused would bench nothing
        refused = gen.loaded.engine.refused if gen.loaded is not None else {}
        if refused:
            raise SystemExit(f"{name}: {refused}")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 1000) for _ in range(100)] for _ in range(args.prompts)]
    rows: dict[str, dict[str, Any]] = {n: {"tokens": 0, "s": 0.0, "head": 0, "head_accepted": 0,
                                           "drafted": 0, "accepted": 0, "texts": []}
                                       for n in gens}
    try:
        for rep in range(args.repeats):
            for name, gen in gens.items():      # alternated, each prompt in a fresh namespace
                for i, p in enumerate(prompts):
                    t0 = time.perf_counter()
                    text, end = await _one(gen, p, args.max_tokens, f"{name}{rep}.{i}")
                    row = rows[name]
                    row["s"] += time.perf_counter() - t0
                    row["tokens"] += end.completion_tokens
                    spec = dict((end.prefixd or {}).get("speculative") or {})
                    row["head"] += spec.get("model_drafted", 0)
                    row["head_accepted"] += spec.get("model_accepted", 0)
                    row["drafted"] += spec.get("drafted", 0)
                    row["accepted"] += spec.get("accepted", 0)
                    if rep == 0:
                        row["texts"].append(text)
    finally:
        for gen in gens.values():
            gen.close()
        shutil.rmtree(root, ignore_errors=True)
    off = rows["speculation off"]["texts"]
    print("| worker | tok/s | drafted / accepted (the head) | drafted / accepted (all) | "
          "replies = off |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['tokens'] / row['s']:.1f} | {row['head']} / "
              f"{row['head_accepted']} | {row['drafted']} / {row['accepted']} | "
              f"{row['texts'] == off} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, default=None,
                        help="the tiny model writes only this many word tokens")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bits", type=int, default=4, help="the quantized head's bits")
    parser.add_argument("--group-size", type=int, default=64)
    asyncio.run(main(parser.parse_args()))
