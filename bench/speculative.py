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

    ./run bench speculative
    ./run bench speculative --shapes edit,prose --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interactive import builtin_f32
from multiturn import OUT, start_server, stop_server, stream_chat, wait_ready

from prefixd.backends.mlx.model.tiny import save_tiny_model

SHAPES = ("rewrite", "edit", "patch", "paths", "json", "prose")
SYSTEM = "You are a coding agent. Follow the instructions exactly."

# Two files: the conversation shows the agent's answer on the first (a turn earlier in the
# conversation, as agents' histories do), the request asks the same of the second.
LIMITER = '''import time


class RateLimiter:
    """Allows `rate` calls per second, in bursts of at most `burst`."""

    def __init__(self, rate: float, burst: int = 10) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False
'''

PACING = '''from dataclasses import dataclass


@dataclass
class Pacing:
    """What the caller decides before each step: the next pass's size in tokens, and
    whether a pass under way pauses between two layers."""

    tokens: int
    share: int = 0
    pausable: bool = True

    def next_size(self, remaining: int) -> int:
        if remaining <= 0:
            return 0
        size = min(self.tokens, remaining)
        if self.share and size > self.share:
            size = self.share
        return max(1, size)

    def pauses(self, waiting: int) -> bool:
        return self.pausable and waiting > 0
'''


def _method(src: str, name: str) -> str:
    lines = src.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith(f"def {name}("))
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].strip().startswith("def ")), len(lines))
    return "\n".join(lines[start:end]).rstrip()


def _patch(path: str, old: str, new: str) -> str:
    body = "\n".join([*("-" + ln for ln in old.splitlines()),
                      *("+" + ln for ln in new.splitlines())])
    return f"*** Begin Patch\n*** Update File: {path}\n@@\n{body}\n*** End Patch"


def _record(job: str, name: str, status: str) -> dict[str, Any]:
    return {"id": job, "status": status, "owner": {"name": name,
            "email": f"{name.split()[0].lower()}@example.com"},
            "labels": ["cache", "prefix", "worker"],
            "limits": {"cpu": 2, "memory_gb": 24, "max_tokens": 4096},
            "created": "2026-11-28T09:31:33Z", "steps": [
                {"name": "restore", "ms": 12}, {"name": "prefill", "ms": 840},
                {"name": "decode", "ms": 5120}]}


def _turns(ask: Callable[[str, str], str], answer: Callable[[str], str],
           example: tuple[str, str], task: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": ask(*example)},
            {"role": "assistant", "content": answer(example[1])},
            {"role": "user", "content": ask(*task)}]


def conversations() -> dict[str, list[dict[str, str]]]:
    files = (("limiter.py", LIMITER), ("pacing.py", PACING))
    renames = {"limiter.py": ("RateLimiter", "Limiter"), "pacing.py": ("Pacing", "Pace")}
    edits = {"limiter.py": ("allow", "return False", "return self.tokens >= 1"),
             "pacing.py": ("pauses", "waiting > 0", "waiting > 1")}

    def fence(path: str, src: str) -> str:
        return f"Here is the file {path}:\n```python\n{src}```\n"

    def rewrite_ask(path: str, src: str) -> str:
        old, new = renames[path]
        return fence(path, src) + (f"Rewrite the whole file with the class `{old}` renamed to "
                                   f"`{new}`. Reply with the full file only.")

    def rewrite_answer(src: str) -> str:
        path = next(p for p, s in files if s == src)
        return "```python\n" + src.replace(*renames[path]) + "```"

    def edit_ask(path: str, src: str) -> str:
        name, old, new = edits[path]
        return fence(path, src) + (f"Use the Edit tool to change `{old}` to `{new}` in "
                                   f"`{name}`. Reply with the tool call's JSON arguments: "
                                   "file_path, old_string (the whole method as it is), "
                                   "new_string (the method after the change).")

    def edit_answer(src: str) -> str:
        path = next(p for p, s in files if s == src)
        name, old, new = edits[path]
        method = _method(src, name)
        return json.dumps({"file_path": path, "old_string": method,
                           "new_string": method.replace(old, new)}, indent=1)

    def patch_ask(path: str, src: str) -> str:
        name, old, new = edits[path]
        return fence(path, src) + (f"Write an apply_patch patch that changes `{old}` to "
                                   f"`{new}` in `{name}`, the whole method in - and + lines.")

    def patch_answer(src: str) -> str:
        path = next(p for p, s in files if s == src)
        name, old, new = edits[path]
        method = _method(src, name)
        return _patch(path, method, method.replace(old, new))

    listing = {"src": [f"src/prefixd/{d}/{m}.py" for d in ("engine", "cache")
                       for m in ("run", "batch", "store", "tap", "probe")],
               "tests": [f"tests/test_{m}_{k}.py" for m in ("engine", "cache", "worker")
                         for k in ("unit", "e2e", "load", "disk")]}

    def paths_ask(kind: str, listed: str) -> str:
        return (f"The tool `list_files` returned:\n{listed}\nCall the tool `read_file` on "
                "every path above, in order: one JSON object per line.")

    def paths_answer(listed: str) -> str:
        return "\n".join(json.dumps({"name": "read_file", "arguments": {"path": p}})
                         for p in listed.splitlines())

    records = {"a": _record("job-17", "Grace Hopper", "queued"),
               "b": _record("job-4711", "Ada Lovelace", "running")}

    def json_ask(key: str, text: str) -> str:
        return (f"The tool `get_job` returned:\n{text}\nReturn this JSON object exactly as "
                'it is, with "status" set to "done". Reply with the JSON only.')

    def json_answer(text: str) -> str:
        return json.dumps({**json.loads(text), "status": "done"}, indent=2)

    return {
        "rewrite": _turns(rewrite_ask, rewrite_answer, files[0], files[1]),
        "edit": _turns(edit_ask, edit_answer, files[0], files[1]),
        "patch": _turns(patch_ask, patch_answer, files[0], files[1]),
        "paths": _turns(paths_ask, paths_answer, ("src", "\n".join(listing["src"])),
                        ("tests", "\n".join(listing["tests"]))),
        "json": _turns(json_ask, json_answer, ("a", json.dumps(records["a"], indent=2)),
                       ("b", json.dumps(records["b"], indent=2))),
        "prose": [{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "Write a short story, about 200 words, about a "
                   "lighthouse keeper who finds a message in a bottle."}],
    }


def words_model(arch: str, models_dir: Path) -> Path:
    """A tiny random `arch` that writes only six words: its replies repeat themselves, so
    there is something to copy (a random tiny model's text has nothing)."""
    path = models_dir / f"{arch}-words"
    if not (path / "model.safetensors").exists():
        save_tiny_model(arch, path, words=6)
    return path


def body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def measure(port: int, text: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    reply, usage, ttft, total = stream_chat(port, body(text, max_tokens), timeout=900)
    n = int(usage.get("completion_tokens", 0))
    spec = (usage.get("prefixd") or {}).get("speculative") or {}
    return {"text": reply, "tokens": n, "ttft": ttft, "decode_s": total - ttft,
            "rate": (n - 1) / (total - ttft) if n > 1 and total > ttft else None,
            "drafted": spec.get("drafted"), "accepted": spec.get("accepted"),
            "passes": spec.get("passes"), "model_drafted": spec.get("model_drafted")}


SERVERS: dict[str, tuple[str, dict[str, str], bool]] = {
    # name: (kind, env, whether stock gets --draft-model)
    "prefixd": ("prefixd", {}, False),
    "prefixd-off": ("prefixd", {"PREFIXD_SPECULATIVE": "false"}, False),
    "prefixd-draft": ("prefixd", {}, True),
    "stock": ("stock", {}, False),
    "stock-draft": ("stock", {}, True),
}


def run_model(model_dir: Path, names: list[str], args: argparse.Namespace,
              texts: dict[str, list[dict[str, str]]], max_tokens: int) -> dict[str, Any]:
    """Every server in `names` up at once (idle while another answers), each request sent to
    each server in turn: the same machine state for all of them."""
    servers, out = {}, {}
    try:
        for name in names:
            kind, env, draft = SERVERS[name]
            if draft and kind == "prefixd":
                env = {**env, "PREFIXD_SPEC_DRAFT_MODEL": str(model_dir)}
            ns = argparse.Namespace(prefixd_env={"PREFIXD_DISK_CACHE_BYTES": "0", **env},
                                    kv_bits=None, out=args.out / "speculative-logs")
            extra = ("--draft-model", str(model_dir)) if draft and kind == "stock" else ()
            servers[name] = start_server(kind, model_dir, ns, extra=extra, label=name)
        for name, server in servers.items():
            out[name] = {}
            try:
                wait_ready(server)
                stream_chat(server.port, body([{"role": "user", "content": "warm up"}], 4),
                            timeout=300)
            except RuntimeError as e:       # stock refusing a draft model on a hybrid
                out[name] = {"refused": str(e)[:300], "log": _log_tail(args, model_dir, name)}
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
        for name in [n for n in live if n in TOGETHER] if args.together and edits else []:
            out[name]["together"] = together(servers[name].port, edits, max_tokens,
                                             out[name])
            print(f"  {model_dir.name} {name} together: {out[name]['together']}", flush=True)
    finally:
        for server in servers.values():
            stop_server(server)
    return out


TOGETHER = ("prefixd", "prefixd-off", "stock")


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


def _log_tail(args: argparse.Namespace, model_dir: Path, name: str) -> str:
    path = args.out / "speculative-logs" / "logs" / f"{model_dir.name}-{name}.log"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    hits = [ln for ln in lines if "Speculative" in ln or "Error" in ln]
    return (hits or lines[-3:] or [""])[-1][:300]


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
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
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
        results[model] = run_model(model_dir, names, args, texts, args.max_tokens)
        text += table(model, results[model], shapes) + "\n"
    text = f"# bench/speculative.py ({time.monotonic() - t0:.0f} s)\n\n" + text
    print(text)
    (args.out / "speculative.json").write_text(json.dumps(results, indent=1))
    (args.out / "speculative.md").write_text(text)
    plot(results, shapes, args.out / "speculative.png")
    print(f"wrote {args.out}/speculative.json, speculative.md, speculative.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
