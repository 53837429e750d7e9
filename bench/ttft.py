"""Append-only turns, time to first token per turn: prefixd's worker beside stock `mlx_lm.server`.

    ./run bench ttft                                   # 3 models x 3 repeats, ~5 min here
    ./run bench ttft --models qwen3_next --repeats 5

Issue 18 ("checkpoints for free"): on turns where both servers reuse exactly the same tokens
(each turn appends the previous reply and ~260 new user tokens, so both restore the previous
prompt + reply), prefixd's checkpointing must cost (almost) nothing. For each tiny model both
servers run at once on the same folder (`multiturn.py`'s helpers); every repeat plays a fresh
6-turn conversation (a new seed, so turn 0 is cold on both) on both servers in lockstep, turn
by turn, the server going first alternating. Per turn: each server's TTFT (streaming, to the first
content token), cached tokens, and prefixd's `prefixd` breakdown from its usage chunk.
Writes bench/out/ttft.json, bench/out/ttft.md (tables) and bench/out/ttft.png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from multiturn import (
    OUT,
    ensure_model,
    start_server,
    stop_server,
    stream_chat,
    wait_ready,
    warm_up,
)
from workloads import Reply, chat

MODELS = ("qwen3_next", "gemma3_text", "qwen3")
STAGES = ("template", "tokenize", "boundaries", "queue", "lookup", "restore", "prefill",
          "checkpoint", "first_token")


class Player:
    """One server's copy of a conversation of `args.turns` append-only turns."""

    def __init__(self, port: int, seed: str, args: argparse.Namespace) -> None:
        self.port, self.args = port, args
        self.steps = chat(1.0, random.Random(seed), turns=args.turns, per_turn=args.per_turn)
        self.reply: Reply | None = None

    def turn(self, turn: int) -> dict[str, Any]:
        step = self.steps.send(self.reply) if self.reply is not None else next(self.steps)
        body = {**step.body, "max_tokens": self.args.max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        text, usage, ttft, _ = stream_chat(self.port, body)
        self.reply = Reply(text)
        return {"turn": turn, "ttft": ttft, "prompt": usage["prompt_tokens"],
                "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                "prefixd": usage.get("prefixd")}


def bench_model(arch: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    model_dir = ensure_model(arch, args.models_dir)
    servers = {}
    rows: list[dict[str, Any]] = []
    try:
        for kind in ("stock", "prefixd"):
            servers[kind] = start_server(kind, model_dir, args)
        for server in servers.values():
            wait_ready(server)
            warm_up(server, args.max_tokens)
        for rep in range(args.repeats):
            # Both servers play the same conversation in lockstep, turn by turn, the one going
            # first alternating: each pair of TTFTs is taken a moment apart, so load from
            # outside the bench (shared cores) hits both alike.
            players = {kind: Player(servers[kind].port, f"ttft-{arch}-{rep}", args)
                       for kind in servers}
            got: dict[str, list[dict[str, Any]]] = {kind: [] for kind in servers}
            t0 = time.monotonic()
            for turn in range(args.turns):
                order = ("stock", "prefixd") if (rep + turn) % 2 == 0 else ("prefixd", "stock")
                for kind in order:
                    got[kind].append(players[kind].turn(turn))
            for kind, turns in got.items():
                rows += [{"model": arch, "server": kind, "repeat": rep, **r} for r in turns]
                print(f"  {arch:12} repeat {rep} {kind:8} {time.monotonic() - t0:5.1f} s "
                      f"ttft ms {[round(r['ttft'] * 1000) for r in turns]}", flush=True)
    finally:
        for server in servers.values():
            stop_server(server)
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and turn: median and range of each server's TTFT, the ratio of medians, the
    cached tokens, and prefixd's median stage times."""
    groups: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list))
    for r in rows:
        groups[(r["model"], r["turn"])][r["server"]].append(r)
    out = []
    for (model, turn), by in sorted(groups.items()):
        line: dict[str, Any] = {"model": model, "turn": turn}
        for kind, got in by.items():
            ttfts = sorted(r["ttft"] * 1000 for r in got)
            line[kind] = {"median": statistics.median(ttfts), "min": ttfts[0],
                          "max": ttfts[-1], "cached": [r["cached"] for r in got],
                          "prompt": got[0]["prompt"]}
        if "stock" in line and "prefixd" in line:
            line["ratio"] = line["prefixd"]["median"] / line["stock"]["median"]
        turns = [r["prefixd"] for r in by.get("prefixd", []) if r.get("prefixd")]
        if turns:
            line["stages"] = {s: statistics.median(t["timings_ms"].get(s, 0.0) for t in turns)
                              for s in STAGES}
            line["passes"] = statistics.median(len(t["prefill_segments"]) for t in turns)
            line["checkpoints"] = statistics.median(t["checkpoints"]["count"] for t in turns)
            line["checkpoint_bytes"] = statistics.median(t["checkpoints"]["bytes"] for t in turns)
        out.append(line)
    return out


def table(summary: list[dict[str, Any]]) -> str:
    head = ("| model | turn | prompt | cached stock / prefixd | TTFT ms stock: median (min-max) "
            "| TTFT ms prefixd: median (min-max) | prefixd / stock | prefixd prefill passes, "
            "checkpoints (KB) | capture / prefill |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for s in summary:
        st, pd = s.get("stock"), s.get("prefixd")
        if not (st and pd):
            continue
        stages = s.get("stages", {})
        share = stages.get("checkpoint", 0) / max(stages.get("prefill", 0), 1e-9)
        lines.append(
            f"| {s['model']} | {s['turn']} | {pd['prompt']} | "
            f"{statistics.median(st['cached']):.0f} / {statistics.median(pd['cached']):.0f} | "
            f"{st['median']:.1f} ({st['min']:.1f}-{st['max']:.1f}) | "
            f"{pd['median']:.1f} ({pd['min']:.1f}-{pd['max']:.1f}) | {s['ratio']:.3f} | "
            f"{s.get('passes', 0):.0f}, {s.get('checkpoints', 0):.0f} "
            f"({s.get('checkpoint_bytes', 0) / 1024:.0f}) | {share:.1%} |")
    return "\n".join(lines)


def breakdown_table(summary: list[dict[str, Any]]) -> str:
    head = ("| model | turn | " + " | ".join(STAGES) + " |\n|---|---|"
            + "---|" * len(STAGES))
    lines = [head]
    for s in summary:
        if "stages" in s:
            cells = " | ".join(f"{s['stages'][k]:.2f}" for k in STAGES)
            lines.append(f"| {s['model']} | {s['turn']} | {cells} |")
    return "\n".join(lines)


def verdicts(summary: list[dict[str, Any]]) -> str:
    """Issue 18's targets per model, over the warm turns (1 and later)."""
    out = []
    for model in sorted({s["model"] for s in summary}):
        warm = [s for s in summary if s["model"] == model and s["turn"] > 0 and "ratio" in s]
        if not warm:
            continue
        ratio = statistics.median(s["ratio"] for s in warm)
        worst = max(s["ratio"] for s in warm)
        capture = sum(s["stages"]["checkpoint"] for s in warm)
        prefill = sum(s["stages"]["prefill"] for s in warm)
        out.append(f"- {model}: median prefixd/stock TTFT over warm turns {ratio:.3f} "
                   f"(worst turn {worst:.3f}; target <= 1.03), capture {capture:.2f} ms = "
                   f"{capture / max(prefill, 1e-9):.1%} of prefill (target <= 2%)")
    return "\n".join(out)


def plot(summary: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({s["model"] for s in summary})
    fig, axes = plt.subplots(2, len(models), figsize=(4.5 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        rows = [s for s in summary if s["model"] == model and "ratio" in s]
        ax = axes[0][col]
        for kind, color, dx in (("stock", "tab:red", -0.08), ("prefixd", "tab:blue", 0.08)):
            xs = [s["turn"] + dx for s in rows]
            med = [s[kind]["median"] for s in rows]
            err = [[m - s[kind]["min"] for m, s in zip(med, rows, strict=True)],
                   [s[kind]["max"] - m for m, s in zip(med, rows, strict=True)]]
            ax.errorbar(xs, med, yerr=err, fmt="o-", color=color, label=kind, capsize=3)
        ax.set_title(f"{model}: TTFT per turn (median, min-max)")
        ax.set_xlabel("turn")
        ax.set_ylabel("ms")
        ax.legend()
        ax = axes[1][col]
        bottom = [0.0] * len(rows)
        for stage in STAGES:
            vals = [s["stages"][stage] for s in rows]
            ax.bar([s["turn"] for s in rows], vals, bottom=bottom, label=stage)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_title(f"{model}: prefixd worker stages (median ms)")
        ax.set_xlabel("turn")
        ax.set_ylabel("ms")
        if col == len(models) - 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--per-turn", type=int, default=260, help="new user tokens per turn")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--models-dir", type=Path, default=OUT / "models")
    p.add_argument("--prefixd-env", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    args.prefixd_env = dict(kv.split("=", 1) for kv in args.prefixd_env)
    args.kv_bits = None
    rows: list[dict[str, Any]] = []
    for arch in args.models.split(","):
        print(f"{arch}:", flush=True)
        rows += bench_model(arch, args)
    summary = summarize(rows)
    text = "\n\n".join([table(summary), breakdown_table(summary), verdicts(summary)])
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "ttft.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "rows": rows}, indent=1))
    (args.out / "ttft.md").write_text(text + "\n")
    plot(summary, args.out / "ttft.png")
    print(f"wrote {args.out / 'ttft.json'}, ttft.md, ttft.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
