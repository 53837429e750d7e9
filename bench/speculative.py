"""Agents' edits at copy speed (issue 36): decode speed with and without speculative decoding,
prefixd's worker beside stock `mlx_lm.server`, in one run.

Shapes (greedy, each request alone, the same conversations everywhere: the agent's answer to
the same request on another file, then the request):
- rewrite: a whole source file rewritten with one rename;
- edit: an `Edit` tool call, `old_string` / `new_string` copied from the file;
- patch: an `apply_patch` hunk against the file;
- paths: tool calls echoing the paths a tool result listed;
- json: a JSON object from a tool result returned with one field changed;
- prose: a story (nothing to copy: speculation must not cost).

Servers on the built-in model: prefixd (speculation on, its default: prompt lookup),
prefixd-off (`PREFIXD_SPECULATIVE=false`), prefixd-draft (`PREFIXD_SPEC_DRAFT_MODEL` the same
model), stock, and stock-draft (`--draft-model` the same model). The served model is the only
same-tokenizer draft model offline, so each drafted token costs a whole forward pass: the
draft-model rows show each server's draft machinery, not a speed-up. On a hybrid model (tiny
qwen3_next writing six words, so its replies repeat and there is something to copy): prefixd on
and off, prefixd-draft (the hybrid drafting for itself: its draft cache goes back from a
snapshot), and stock with `--draft-model`, whose refusal is shown.
Together (`--together`, on by default): the edit-shaped requests sent at once to each of
prefixd, prefixd-off and stock (agents side by side: prefixd verifies every member's draft in
its decode batch's pass): aggregate rate = all completion tokens / wall time, each reply
compared with the same server's reply to it alone.
Decode rate: (completion tokens - 1) / (time after the first token);
acceptance from the worker's `prefixd.speculative` (accepted / drafted tokens). Every reply is
compared with prefixd-off's, token for token (the text of a greedy reply). All servers of a
model run at once, idle but for the request sent to each in turn (`--repeats` times, median).
The conversations: `specshapes.py`.
Concurrent (`--concurrent 1,4,8`, instead of the shapes): N different edit-shaped requests at
once to each of prefixd, prefixd-off and stock, per N the aggregate decode rate, the median
time per output token, drafts and verify passes, replies against prefixd-off's and stock's
(`speccompany.py`, where each figure is defined). Writes bench/out/speculative.json, .md, .png
(concurrent: speculative_concurrent.json, .md).

    ./run bench speculative
    ./run bench speculative --shapes edit,prose --repeats 1
    ./run bench speculative --models builtin --concurrent 1,4,8
    ./run bench speculative --models qwen3_next --concurrent 1,4 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interactive import builtin_f32
from multiturn import OUT, Server, stop_server
from speccompany import COMPANY, SERVERS, company_table, measure, run_company, start_servers
from specshapes import SHAPES, conversations

from prefixd.backends.mlx.model.tiny import save_tiny_model


def words_model(arch: str, models_dir: Path) -> Path:
    """A tiny random `arch` that writes only six words: its replies repeat themselves, so
    there is something to copy (a random tiny model's text has nothing)."""
    path = models_dir / f"{arch}-words"
    if not (path / "model.safetensors").exists():
        save_tiny_model(arch, path, words=6)
    return path


def run_model(model_dir: Path, names: list[str], args: argparse.Namespace,
              texts: dict[str, list[dict[str, str]]], max_tokens: int) -> dict[str, Any]:
    """Every server in `names` up at once (idle while another answers), each request sent to
    each server in turn: the same machine state for all of them."""
    servers: dict[str, Server] = {}
    try:
        out = start_servers(model_dir, names, args, servers)
        live = [n for n in names if "refused" not in out[n]]
        for shape, text in texts.items():
            runs: dict[str, list[dict[str, Any]]] = {n: [] for n in live}
            for _ in range(args.repeats):
                for name in live:
                    runs[name].append(measure(servers[name].port, text, max_tokens))
            for name in live:
                rates = [r["rate"] for r in runs[name] if r["rate"]]
                r = out[name][shape] = {**runs[name][-1],
                                        "rate": statistics.median(rates) if rates else None}
                print(f"  {model_dir.name} {name} {shape}: {r['tokens']} tokens, "
                      f"{_f(r['rate'])} tok/s, drafted {r['drafted']} accepted "
                      f"{r['accepted']}", flush=True)
        edits = {k: v for k, v in texts.items() if k != "prose"}
        for name in [n for n in live if n in COMPANY] if args.together and edits else []:
            out[name]["together"] = together(servers[name].port, edits, max_tokens,
                                             out[name])
            print(f"  {model_dir.name} {name} together: {out[name]['together']}", flush=True)
    finally:
        for server in servers.values():
            stop_server(server)
    return out


def together(port: int, texts: dict[str, list[dict[str, str]]], max_tokens: int,
             alone: dict[str, Any]) -> dict[str, Any]:
    """Every request of `texts` at once: aggregate decode rate (all completion tokens / wall
    time from the first request out), drafts, and which replies equal this server's alone."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        got = dict(zip(texts, pool.map(lambda t: measure(port, t, max_tokens), texts.values()),
                       strict=True))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in got.values())
    return {"requests": len(got), "tokens": tokens, "wall_s": round(wall, 2),
            "rate": tokens / wall, "drafted": sum(r["drafted"] or 0 for r in got.values()),
            "accepted": sum(r["accepted"] or 0 for r in got.values()),
            "same_as_alone": sum(r["text"] == alone.get(k, {}).get("text")
                                 for k, r in got.items())}


def _f(x: Any, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def table(model: str, results: dict[str, Any], shapes: list[str]) -> str:
    names = list(results)
    base = results.get("prefixd-off", {})
    head = ("| shape | " + " | ".join(f"{n} tok/s" for n in names)
            + " | prefixd / off | prefixd / stock | accepted / drafted (passes) | "
              "tokens | replies = off |")
    lines = [f"### {model}", "", head, "|" + "---|" * (head.count("|") - 1)]
    for shape in shapes:
        row = [results[n].get(shape, {}) for n in names]
        on, off, stock = (results.get(k, {}).get(shape, {})
                          for k in ("prefixd", "prefixd-off", "stock"))
        same = [n for n in names if results[n].get(shape, {}).get("text") is not None
                and results[n][shape]["text"] == base.get(shape, {}).get("text")]
        ratio = (on["rate"] / off["rate"] if on.get("rate") and off.get("rate") else None)
        vs_stock = (on["rate"] / stock["rate"] if on.get("rate") and stock.get("rate")
                    else None)
        acc = (f"{on.get('accepted')} / {on.get('drafted')} ({on.get('passes')})"
               if on.get("drafted") is not None else "-")
        lines.append(f"| {shape} | " + " | ".join(_f(r.get("rate")) for r in row)
                     + f" | {_f(ratio, '.2f')}x | {_f(vs_stock, '.2f')}x | {acc} | "
                       f"{on.get('tokens', '-')} | {', '.join(same) or '-'} |")
    rows = [(n, results[n]["together"]) for n in names if "together" in results[n]]
    if rows:
        lines += ["", f"{model}, the {rows[0][1]['requests']} edit-shaped requests at once:", "",
                  "| server | aggregate tok/s | tokens | wall s | accepted / drafted | "
                  "replies = its own alone |", "|---|---|---|---|---|---|"]
        lines += [f"| {n} | {t['rate']:.1f} | {t['tokens']} | {t['wall_s']} | "
                  f"{t['accepted']} / {t['drafted']} | {t['same_as_alone']} / {t['requests']} |"
                  for n, t in rows]
    for n in names:
        if "refused" in results[n] or "error" in results[n]:
            why = results[n].get("refused") or results[n].get("error")
            lines.append(f"\n{n}: **{why}** {results[n].get('log', '')}")
    by_model = [r.get("model_drafted") for r in results.get("prefixd-draft", {}).values()
                if isinstance(r, dict)]
    if by_model:    # a draft model only drafts where its measured cost pays
        lines.append(f"\nprefixd-draft: its draft model drafted {sum(n or 0 for n in by_model)} "
                     "tokens in all (the rest of its drafts are prompt lookup's)")
    return "\n".join(lines) + "\n"


def plot(all_results: dict[str, Any], shapes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = all_results.get("builtin")
    if not results:
        return
    names = [n for n in results if any(results[n].get(s, {}).get("rate") for s in shapes)]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        rates = [results[n].get(s, {}).get("rate") or 0 for s in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], rates, width, label=n)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(shapes))], shapes)
    ax.set_ylabel("decode tok/s (greedy, one request)")
    ax.set_title("built-in model: speculative decoding (prompt lookup)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="builtin,qwen3_next")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--together", action=argparse.BooleanOptionalAction, default=True,
                    help="also send the edit-shaped requests at once (agents side by side)")
    ap.add_argument("--concurrent", default="", metavar="N,N,...",
                    help="instead of the shapes one at a time: N different edit-shaped requests "
                         "at once, for each N (prefixd, prefixd-off, stock), e.g. 1,4,8")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    ns = [int(n) for n in args.concurrent.split(",") if n]
    args.models_dir = args.out / "models"
    args.cache_dir = Path(os.environ.get("PREFIXD_CACHE_DIR", "~/.cache/prefixd")).expanduser()
    args.out.mkdir(parents=True, exist_ok=True)
    texts = {s: t for s, t in conversations().items() if s in shapes}
    t0 = time.monotonic()
    results: dict[str, Any] = {}
    text = ""
    for model in args.models.split(","):
        builtin = model == "builtin"
        model_dir = builtin_f32(args) if builtin else words_model(model, args.models_dir)
        names = [n for n in args.servers.split(",")
                 if builtin or n in ("prefixd", "prefixd-off", "prefixd-draft", "stock",
                                     "stock-draft")]
        if ns:
            results[model] = run_company(model_dir, names, args, ns, args.max_tokens)
            text += company_table(model, results[model], ns) + "\n"
            continue
        results[model] = run_model(model_dir, names, args, texts, args.max_tokens)
        text += table(model, results[model], shapes) + "\n"
    text = f"# bench/speculative.py ({time.monotonic() - t0:.0f} s)\n\n" + text
    print(text)
    if ns:
        (args.out / "speculative_concurrent.json").write_text(json.dumps(results, indent=1))
        (args.out / "speculative_concurrent.md").write_text(text)
        print(f"wrote {args.out}/speculative_concurrent.json, speculative_concurrent.md")
        return 0
    (args.out / "speculative.json").write_text(json.dumps(results, indent=1))
    (args.out / "speculative.md").write_text(text)
    plot(results, shapes, args.out / "speculative.png")
    print(f"wrote {args.out}/speculative.json, speculative.md, speculative.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
