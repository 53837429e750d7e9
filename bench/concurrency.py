"""Many agents at once (issue 35): prefixd's worker beside stock `mlx_lm.server`, alternated in
one run, on concurrent decodes and on bursts.

Parts (each on both servers, the servers started fresh per part and model, prefixd first):
- N: N = 1, 2, 4, 8, 16 concurrent greedy requests with distinct ~120-token prompts (seeded
  words), `--max-tokens` each (128 tiny, 32 built-in). Aggregate decode rate (completion tokens
  of all requests / wall time of the burst) and each request's time per output token after its
  first; every reply compared with the same prompt's reply alone on the same server.
- burst: four requests sharing a ~1,500-token system prompt (distinct questions) sent in the
  same instant: their cached tokens and slowest first token; then their second turns together;
  then a late sub-agent: sent once another with a new system prompt decodes (4x the tokens),
  its cached tokens and first token (and the same request's first token on a cold prompt).
- hol: 20 long prompts (~1,000 tokens) sent together, then 10 short ones right behind them:
  the shorts' TTFT against the same short alone.

prefixd's worker runs at its defaults (it ranks up to 64 requests, admits by memory, batches
their decode steps; through the daemon the proxy forwards it every request), without a disk
tier; stock at its defaults. Peak RSS is
each process's VmHWM. Writes bench/out/concurrency.json, .md and concurrency_<model>.png.

    ./run bench concurrency                    # tiny qwen3_next and the built-in model
    ./run bench concurrency --models qwen3_next --parts n --ns 1,4
    ./run bench concurrency --models builtin --parts n --ns 4,8 --cold   # bursts prefill
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interactive import builtin_f32
from multiturn import OUT, ensure_model, start_server, stop_server, stream_chat, wait_ready
from workloads import words

SERVERS = ("prefixd", "stock")
PARTS = ("n", "burst", "hol")


def body(messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}


def ask(port: int, b: dict[str, Any], out: dict[str, Any], t0: float,
        first: Callable[[], None] | None = None) -> None:
    """One streamed request; its results in `out` (never raises: an error is a result).
    `first` is called at its first token."""
    sent = time.perf_counter()
    try:
        text, usage, ttft, total = stream_chat(port, b, timeout=900, first=first)
    except Exception as e:
        out.update(error=f"{type(e).__name__}: {e}", end=time.perf_counter() - t0)
        return
    out.update(text=text, ttft=ttft, total=total, end=time.perf_counter() - t0,
               start=sent - t0, completion=int(usage.get("completion_tokens", 0)),
               cached=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                          or 0))


def together(port: int, bodies: list[dict[str, Any]], gap: float = 0.0) -> tuple[list[dict],
                                                                               float]:
    """Send `bodies` concurrently (`gap` s apart); their results and the burst's wall time."""
    outs: list[dict[str, Any]] = [{} for _ in bodies]
    t0 = time.perf_counter()
    threads = []
    for i, b in enumerate(bodies):
        threads.append(threading.Thread(target=ask, args=(port, b, outs[i], t0), daemon=True))
        threads[-1].start()
        if gap:
            time.sleep(gap)
    for t in threads:
        t.join(960)
    return outs, time.perf_counter() - t0


def tpot(o: dict[str, Any]) -> float | None:
    n = o.get("completion", 0)
    return (o["total"] - o["ttft"]) / (n - 1) if n > 1 and "total" in o else None


def part_n(port: int, args: argparse.Namespace, seed: str) -> dict[str, Any]:
    """Each N's burst; by default of prompts each server answered alone first (warm: the
    burst is decode), with `--cold` of prompts new to the server (the burst prefills them,
    then each is sent alone to compare)."""
    rng = random.Random(seed)
    fresh = lambda n: [body([{"role": "user", "content": words(rng, 90)}],  # noqa: E731
                            args.max_tokens) for _ in range(n)]
    prompts = [] if args.cold else fresh(max(args.ns))
    alone, rows = [together(port, [p])[0][0] for p in prompts], []
    for n in args.ns:
        if args.cold:
            prompts = fresh(n)
        outs, wall = together(port, prompts[:n])
        if args.cold:
            alone = [together(port, [p])[0][0] for p in prompts]
        tokens = sum(o.get("completion", 0) for o in outs)
        tp = [t for o in outs if (t := tpot(o)) is not None]
        rows.append({"n": n, "wall": wall, "tokens": tokens, "rate": tokens / wall,
                     "tpot_median": statistics.median(tp) if tp else None,
                     "ttft_median": statistics.median(
                         [o["ttft"] for o in outs if o.get("ttft") is not None] or [0.0]),
                     "tpot_alone": statistics.median(
                         [t for o in alone[:n] if (t := tpot(o)) is not None] or [0.0]),
                     "errors": sum("error" in o for o in outs),
                     "same_as_alone": sum(o.get("text") == a.get("text")
                                          for o, a in zip(outs, alone, strict=False))})
        print(f"    N={n:2}: {tokens / wall:7.1f} tok/s, {rows[-1]['errors']} errors "
              f"{[o['error'] for o in outs if 'error' in o][:1]}", flush=True)
    return {"rows": rows}


def part_burst(port: int, args: argparse.Namespace, seed: str) -> dict[str, Any]:
    rng = random.Random(seed)
    system = "You are a sub-agent of a coding agent. " + words(rng, args.shared)
    firsts = [[{"role": "system", "content": system},
               {"role": "user", "content": f"Task {i}: " + words(rng, 30)}] for i in range(4)]
    one, _ = together(port, [body(m, args.max_tokens) for m in firsts])
    seconds = [[*m, {"role": "assistant", "content": o.get("text", "")},
                {"role": "user", "content": "And then? " + words(rng, 40)}]
               for m, o in zip(firsts, one, strict=True)]
    two, _ = together(port, [body(m, args.max_tokens) for m in seconds])
    return {"first": [{k: o.get(k) for k in ("cached", "ttft", "total", "error")} for o in one],
            "second": [{k: o.get(k) for k in ("cached", "ttft", "total", "error")}
                       for o in two],
            "late": late_agent(port, args, rng)}


def late_agent(port: int, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """A sub-agent sent once another with the same (new) system prompt decodes a longer reply:
    its cached tokens and first token, and the same sub-agent's first token alone on a cold
    prompt for scale (in the JSON also when each ended and their tokens)."""
    system = "You are a reviewing sub-agent. " + words(rng, args.shared)
    running, late = ({"role": "system", "content": system},
                     {"role": "user", "content": "Review: " + words(rng, 30)}), \
        [{"role": "system", "content": system},
         {"role": "user", "content": "Check: " + words(rng, 30)}]
    outs: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    decoding = threading.Event()
    t0 = time.perf_counter()

    def after_first_token() -> None:
        if decoding.wait(900):
            ask(port, body(late, args.max_tokens), outs[1], t0)

    sent = threading.Thread(target=after_first_token, daemon=True)
    sent.start()
    ask(port, body(list(running), args.max_tokens * 4), outs[0], t0, decoding.set)
    sent.join(960)
    cold: dict[str, Any] = {}
    ask(port, body([{**late[0], "content": "Fresh. " + system}, late[1]], args.max_tokens),
        cold, time.perf_counter())
    return {"cached": outs[1].get("cached"), "ttft": outs[1].get("ttft"),
            "cold_ttft": cold.get("ttft"),
            "before_end": outs[1].get("end", float("inf")) < outs[0].get("end", 0.0),
            "ends": [o.get("end") for o in outs], "sent": outs[1].get("start"),
            "tokens": [o.get("completion") for o in outs],
            "error": outs[0].get("error") or outs[1].get("error")}


def part_hol(port: int, args: argparse.Namespace, seed: str) -> dict[str, Any]:
    rng = random.Random(seed)
    longs = [body([{"role": "user", "content": words(rng, args.long)}], 16) for _ in range(20)]
    shorts = [body([{"role": "user", "content": words(rng, 20)}], 8) for _ in range(10)]
    alone = [together(port, [s])[0][0] for s in shorts]
    outs: list[dict[str, Any]] = []

    def shorts_later() -> None:
        time.sleep(0.5)
        outs.extend(together(port, shorts)[0])

    later = threading.Thread(target=shorts_later, daemon=True)
    later.start()
    long_outs, wall = together(port, longs)
    later.join(960)
    ratios = [o["ttft"] / a["ttft"] for o, a in zip(outs, alone, strict=False)
              if "ttft" in o and "ttft" in a and a["ttft"] > 0]
    return {"short_ttft": [o.get("ttft") for o in outs], "alone": [a.get("ttft") for a in alone],
            "ratio_median": statistics.median(ratios) if ratios else None,
            "long_wall": wall, "errors": sum("error" in o for o in [*outs, *long_outs])}


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    builtin = name == "builtin"
    model_dir = builtin_f32(args) if builtin else ensure_model(name, args.models_dir)
    args.max_tokens = args.builtin_max_tokens if builtin else args.tiny_max_tokens
    out: dict[str, Any] = {}
    for part in args.parts:
        for kind in SERVERS:
            ns = argparse.Namespace(prefixd_env={"PREFIXD_DISK_CACHE_BYTES": "0"},
                                    kv_bits=None, out=args.out / "concurrency-logs")
            server = start_server(kind, model_dir, ns)
            try:
                wait_ready(server)
                together(server.port, [body([{"role": "user", "content": "warm up"}], 4)])
                print(f"  {name} {kind} ({part})", flush=True)
                run = {"n": part_n, "burst": part_burst, "hol": part_hol}[part]
                result = run(server.port, args, f"{name}-{part}")
            finally:
                stop_server(server)
            result["peak_rss"] = server.peak_rss
            out.setdefault(part, {})[kind] = result
    return out


def _f(x: Any, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def tables(results: dict[str, Any]) -> str:
    lines = []
    for model, parts in results.items():
        if "n" in parts:
            lines += [f"### {model}: concurrent decodes", "",
                      "| N | prefixd tok/s (vs its N=1) | stock tok/s (vs its N=1) | prefixd TPOT "
                      "ms (alone) | stock TPOT ms (alone) | first token s, median: prefixd / "
                      "stock | replies = alone: prefixd / stock |",
                      "|---|---|---|---|---|---|---|"]
            p, s = parts["n"]["prefixd"]["rows"], parts["n"]["stock"]["rows"]
            for a, b in zip(p, s, strict=True):
                lines.append(
                    f"| {a['n']} | {a['rate']:.1f} ({a['rate'] / (p[0]['rate'] or 1):.2f}) | "
                    f"{b['rate']:.1f} ({b['rate'] / (s[0]['rate'] or 1):.2f}) | "
                    f"{_f(a['tpot_median'] and 1000 * a['tpot_median'])} "
                    f"({_f(1000 * a['tpot_alone'])}) | "
                    f"{_f(b['tpot_median'] and 1000 * b['tpot_median'])} "
                    f"({_f(1000 * b['tpot_alone'])}) | {_f(a.get('ttft_median'), '.2f')} / "
                    f"{_f(b.get('ttft_median'), '.2f')} | {a['same_as_alone']}/{a['n']} / "
                    f"{b['same_as_alone']}/{b['n']} |")
            rss = {k: parts["n"][k]["peak_rss"] / 2**20 for k in SERVERS}
            lines += ["", f"Peak RSS MiB: prefixd {rss['prefixd']:.0f}, stock {rss['stock']:.0f}",
                      ""]
        if "burst" in parts:
            lines += [f"### {model}: four sub-agents sharing a system prompt, same instant", "",
                      "| server | first turns: cached | slowest first token s | second turns: "
                      "cached | slowest first token s | peak RSS MiB |",
                      "|---|---|---|---|---|---|"]
            for kind, r in parts["burst"].items():
                f1, f2 = r["first"], r["second"]
                lines.append(f"| {kind} | {[o['cached'] for o in f1]} | "
                             f"{_f(max(o['ttft'] or 0 for o in f1), '.2f')} | "
                             f"{[o['cached'] for o in f2]} | "
                             f"{_f(max(o['ttft'] or 0 for o in f2), '.2f')} | "
                             f"{r['peak_rss'] / 2**20:.0f} |")
            lines += ["", f"### {model}: a sub-agent sent while another with its system prompt "
                      "decodes", "", "| server | cached | first token s | alone, cold prompt s "
                      "| error |", "|---|---|---|---|---|"]
            for kind, r in parts["burst"].items():
                late = r.get("late") or {}
                lines.append(f"| {kind} | {late.get('cached')} | {_f(late.get('ttft'), '.2f')} "
                             f"| {_f(late.get('cold_ttft'), '.2f')} | {late.get('error') or ''} |")
            lines.append("")
        if "hol" in parts:
            lines += [f"### {model}: 10 short requests behind 20 long ones", "",
                      "| server | short TTFT / alone (median) | shorts' TTFT s (max) | the longs' "
                      "wall s | errors | peak RSS MiB |", "|---|---|---|---|---|---|"]
            for kind, r in parts["hol"].items():
                worst = max((t or 0 for t in r["short_ttft"]), default=None)
                lines.append(f"| {kind} | {_f(r['ratio_median'], '.2f')}x | {_f(worst, '.2f')} | "
                             f"{r['long_wall']:.1f} | {r['errors']} | "
                             f"{r['peak_rss'] / 2**20:.0f} |")
            lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in results if "n" in results[m]]
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for kind in SERVERS:
            rows = results[model]["n"][kind]["rows"]
            ax.plot([r["n"] for r in rows], [r["rate"] for r in rows], marker="o", label=kind)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate tok/s")
        ax.set_title(model)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3_next,builtin")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--ns", default="1,2,4,8,16")
    ap.add_argument("--cold", action="store_true",
                    help="N part: each burst of prompts new to the server (default: warm)")
    ap.add_argument("--tiny-max-tokens", type=int, default=128)
    ap.add_argument("--builtin-max-tokens", type=int, default=32)
    ap.add_argument("--shared", type=int, default=1100, help="words of the shared system prompt")
    ap.add_argument("--long", type=int, default=750, help="words of each long prompt (hol)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    args.ns = [int(n) for n in args.ns.split(",")]
    args.parts = [p for p in args.parts.split(",") if p]
    args.models_dir = args.out / "models"
    args.cache_dir = Path(os.environ.get("PREFIXD_CACHE_DIR", "~/.cache/prefixd")).expanduser()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    t0 = time.monotonic()
    for name in args.models.split(","):
        results[name] = run_model(name, args)
    text = f"# bench/concurrency.py ({time.monotonic() - t0:.0f} s)\n\n" + tables(results)
    print(text)
    (args.out / "concurrency.json").write_text(json.dumps(results, indent=1))
    (args.out / "concurrency.md").write_text(text + "\n")
    plot(results, args.out / "concurrency.png")
    print(f"wrote {args.out}/concurrency.json, concurrency.md, concurrency.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
