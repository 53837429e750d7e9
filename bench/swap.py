"""Two models under one memory budget (issue 16): what a swap costs, per turn.

    ./run bench swap                          # scenarios a, b, c; 10 turns per conversation
    ./run bench swap --scenarios ab --turns 4

Two tiny models, a hybrid (qwen3_next: Gated-DeltaNet layers + attention) and a sliding-window
one (gemma3_text), written once under bench/out/models/, are the two managed backends of one
`prefixd serve` subprocess (loopback, a fresh PREFIXD_CACHE_DIR per scenario, no cache budget
configured: each worker gets `--cache-bytes`). Two conversations, one per model, alternate:
hybrid turn 1, sliding turn 1, hybrid turn 2, ... streaming, temperature 0, the model's reply
kept in the history. Scenarios:

  a  PREFIXD_MODEL_MEMORY_BYTES fits both models: nothing is swapped (the reference)
  b  it fits one; the worker's disk tier off (PREFIXD_DISK_CACHE_BYTES=0): every turn swaps
  c  it fits one; the disk tier on (its default)

Per turn: `wait`, what the request waited for its model (unloading the other + starting its
worker: prefixd_model_load_wait_seconds), `load`, the worker's start alone
(prefixd_model_load_seconds), TTFT as the client sees it, cached / prompt tokens (usage), the
workers loaded after the turn (/status) and whether the reply is the same as in (a). The
issue's targets, for every turn after a swap: cached tokens >= the conversation's previous
prompt, and TTFT <= wait + 1.5x the same turn's TTFT in (a). Writes bench/out/swap.json,
swap.md and swap.png. Every process it starts (prefixd; prefixd stops its workers) is stopped
by its PID, also on error or after --deadline-s.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from multiturn import ensure_model, free_port, stream_chat
from prometheus_client.parser import text_string_to_metric_families

from prefixd.backends.budget import estimate_footprint, weights_bytes
from prefixd.backends.mlx.model.tinytok import WORDS

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
MODELS = {"hybrid": "qwen3_next", "sliding": "gemma3_text"}
GiB = 2**30
SCENARIOS = {"a": "both fit", "b": "swap, disk tier off", "c": "swap, disk tier on"}


class Deadline(RuntimeError):
    pass


class Prefixd:
    """One `prefixd serve` subprocess; `stop()` ends it (and any worker left) by PID."""

    def __init__(self, backends: list[dict], budget: int, cache_dir: Path, log: Path) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
        env.update({"PREFIXD_BACKENDS": json.dumps(backends), "PREFIXD_PORT": str(self.port),
                    "PREFIXD_MODEL_MEMORY_BYTES": str(budget),
                    "PREFIXD_CACHE_DIR": str(cache_dir), "HF_HUB_OFFLINE": "1"})
        self._log = log.open("wb")
        # cwd: the fresh cache dir, so no ./prefixd.env is read
        self.proc = subprocess.Popen([sys.executable, "-m", "prefixd.proxy.cli", "serve"],
                                     env=env, cwd=cache_dir, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self.workers: set[int] = set()

    def request(self, method: str, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def get_json(self, path: str) -> dict[str, Any]:
        status, body = self.request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}")
        return json.loads(body)

    def wait_loaded(self, n: int, deadline: float) -> None:
        """Until the start-up loads are done: `n` models loaded and ready."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefixd exited with {self.proc.returncode}")
            with contextlib.suppress(OSError, RuntimeError, http.client.HTTPException):
                status = self.get_json("/status")
                if sum(b["state"] == "ready" for b in status["backends"]) >= n:
                    return
            time.sleep(0.25)   # across a process boundary: nothing to wait on but polls
        raise Deadline("prefixd's models did not load in time")

    def worker_pids(self) -> set[int]:
        with contextlib.suppress(psutil.Error):
            kids = psutil.Process(self.proc.pid).children(recursive=True)
            self.workers |= {k.pid for k in kids}
            return {k.pid for k in kids}
        return set()

    def stop(self) -> None:
        self.worker_pids()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.workers:       # prefixd stops its workers; a leftover is killed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self._log.close()


def sums(text: str) -> dict[tuple[str, str], float]:
    """(sample name, backend) -> value, for the model load metrics."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("prefixd_model_load"):
            for s in family.samples:
                if s.name.endswith(("_sum", "_count")):
                    out[(s.name, s.labels.get("backend", ""))] = s.value
    return out


def conversations(turns: int, seed: int = 0) -> dict[str, list[str]]:
    """Per model: a system prompt (~300 words) and `turns` user messages (~100 words each)."""
    def words(rng: random.Random, n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    out = {}
    for i, model in enumerate(MODELS):
        rng = random.Random(seed + i)
        out[model] = [words(rng, 300)] + [f"Turn {t + 1}: {words(rng, 100)}"
                                          for t in range(turns)]
    return out


def run_scenario(name: str, args: argparse.Namespace, paths: dict[str, Path],
                 texts: dict[str, list[str]], deadline: float) -> dict[str, Any]:
    swap = name != "a"
    budget = args.budget_one if swap else args.budget_both
    backends = [{"name": model, "kind": "mlx", "model": str(paths[model]), "models": [model],
                 "cache_bytes": args.cache_bytes,
                 "worker_env": {"PREFIXD_DISK_CACHE_BYTES": "0"} if name == "b" else {}}
                for model in MODELS]
    cache_dir = Path(tempfile.mkdtemp(prefix=f"prefixd-swap-{name}-"))
    server = Prefixd(backends, budget, cache_dir, args.out / "logs" / f"swap-{name}.log")
    rows: list[dict[str, Any]] = []
    try:
        server.wait_loaded(1 if swap else 2, deadline)
        history: dict[str, list[dict[str, str]]] = {
            m: [{"role": "system", "content": texts[m][0]}] for m in MODELS}
        before = sums(server.request("GET", "/metrics")[1].decode())
        for turn in range(1, args.turns + 1):
            for model in MODELS:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Deadline(f"--deadline-s reached in ({name}) turn {turn}")
                history[model].append({"role": "user", "content": texts[model][turn]})
                body = {"model": model, "messages": history[model], "stream": True,
                        "stream_options": {"include_usage": True}, "temperature": 0,
                        "max_tokens": args.max_tokens}
                reply, usage, ttft, _ = stream_chat(server.port, body, min(left, 300.0))
                history[model].append({"role": "assistant", "content": reply})
                after = sums(server.request("GET", "/metrics")[1].decode())
                grew = {metric: after.get((metric, model), 0.0) - before.get((metric, model), 0.0)
                        for metric in ("prefixd_model_load_wait_seconds_sum",
                                       "prefixd_model_load_seconds_sum",
                                       "prefixd_model_load_seconds_count")}
                status = server.get_json("/status")
                rows.append({
                    "scenario": name, "model": model, "turn": turn, "ttft": ttft,
                    "wait": grew["prefixd_model_load_wait_seconds_sum"],
                    "load": grew["prefixd_model_load_seconds_sum"],
                    "loads": int(grew["prefixd_model_load_seconds_count"]),
                    "prompt": usage.get("prompt_tokens", 0),
                    "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                    "loaded": status.get("model_memory", {}).get("loaded", []),
                    "workers": len(server.worker_pids()), "reply": reply,
                    # the worker's own stages of this turn (ms): where the time after the load went
                    "worker_ms": (usage.get("prefixd") or {}).get("timings_ms")})
                before = after
        footprints = {b["name"]: (b.get("footprint_bytes"), b.get("footprint_source"),
                                  (b.get("cache") or {}).get("budget"))
                      for b in server.get_json("/status")["backends"]}
    finally:
        server.stop()
        shutil.rmtree(cache_dir, ignore_errors=True)
    return {"scenario": name, "budget": budget, "rows": rows, "footprints": footprints}


def check_targets(runs: dict[str, dict], name: str) -> dict[str, Any]:
    """The issue's targets for the turns after a swap in scenario `name`."""
    ref = {(r["model"], r["turn"]): r for r in runs["a"]["rows"]} if "a" in runs else {}
    rows = runs[name]["rows"]
    prev: dict[str, int] = {}
    warm = fast = same = swapped = 0
    for r in rows:
        if r["loads"] and r["model"] in prev:            # a turn after a swap
            swapped += 1
            warm += r["cached"] >= prev[r["model"]]
            a = ref.get((r["model"], r["turn"]))
            fast += a is not None and r["ttft"] <= r["wait"] + 1.5 * a["ttft"]
        a = ref.get((r["model"], r["turn"]))
        same += a is not None and a["reply"] == r["reply"]
        prev[r["model"]] = r["prompt"]
    return {"swapped_turns": swapped, "warm": warm, "fast": fast, "same_reply": same,
            "turns": len(rows), "max_workers": max((r["workers"] for r in rows), default=0)}


def table(runs: dict[str, dict]) -> str:
    names = list(runs)
    head = "| turn | model | " + " | ".join(
        f"({n}) wait s | ({n}) load s | ({n}) TTFT s | ({n}) cached/prompt" for n in names)
    lines = [head + " |", "|---|---|" + "---:|" * (4 * len(names))]
    keyed = {n: {(r["model"], r["turn"]): r for r in runs[n]["rows"]} for n in names}
    for r in runs[names[0]]["rows"]:
        cells = []
        for n in names:
            x = keyed[n].get((r["model"], r["turn"]))
            cells += (["—"] * 4 if x is None else
                      [f"{x['wait']:.2f}", f"{x['load']:.2f}", f"{x['ttft']:.3f}",
                       f"{x['cached']}/{x['prompt']}"])
        lines.append(f"| {r['turn']} | {r['model']} | " + " | ".join(cells) + " |")
    lines += ["", "| scenario | budget | turns after a swap | cached >= previous prompt | "
              "TTFT <= wait + 1.5x (a) | reply same as (a) | most workers at once | "
              "footprints |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for n in names:
        t = check_targets(runs, n)
        prints = ", ".join(f"{m} {f / 2**20:.0f} MiB ({src})"
                           for m, (f, src, _) in runs[n]["footprints"].items() if f is not None)
        lines.append(f"| ({n}) {SCENARIOS[n]} | {runs[n]['budget'] / GiB:.2f} GiB "
                     f"| {t['swapped_turns']} | {t['warm']} | {t['fast']} "
                     f"| {t['same_reply']}/{t['turns']} | {t['max_workers']} | {prints} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    colors = {"a": "tab:green", "b": "tab:red", "c": "tab:blue"}
    panels = ((lambda r: r["ttft"], "TTFT (s), incl. waiting for the model", True),
              (lambda r: max(1e-3, r["ttft"] - r["wait"]), "TTFT - wait (s): the prompt", True),
              (lambda r: r["cached"] / max(1, r["prompt"]), "cached / prompt tokens", False))
    for name, run in runs.items():
        for model, marker in zip(MODELS, ("o", "s"), strict=True):
            got = [r for r in run["rows"] if r["model"] == model]
            for ax, (value, _, _) in zip(axes, panels, strict=True):
                ax.plot([r["turn"] for r in got], [value(r) for r in got], marker=marker,
                        color=colors[name], label=f"({name}) {model}", linewidth=1,
                        markersize=4)
    for ax, (_, label, log) in zip(axes, panels, strict=True):
        ax.set_ylabel(label, fontsize=9)
        ax.set_xlabel("turn of the conversation", fontsize=9)
        if log:
            ax.set_yscale("log")
    axes[2].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default="abc", help="any of a, b, c (default: abc)")
    ap.add_argument("--turns", type=int, default=10, help="turns per conversation")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--cache-bytes", type=int, default=512 * 2**20,
                    help="each model's prompt-cache budget (RAM)")
    ap.add_argument("--budget-one", type=int, default=None,
                    help="PREFIXD_MODEL_MEMORY_BYTES that fits one model (b, c); default: "
                    "one model's estimate + 64 MiB, less than two cache budgets")
    ap.add_argument("--budget-both", type=int, default=None,
                    help="PREFIXD_MODEL_MEMORY_BYTES that fits both (a); default: 4x --budget-one")
    ap.add_argument("--deadline-s", type=float, default=1800.0, help="for the whole run")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.deadline_s
    paths = {m: ensure_model(arch, args.out / "models") for m, arch in MODELS.items()}
    # Estimated footprint: weights + cache budget + process overhead; measured once loaded
    # (the tiny models' processes hold less than the overhead assumed, so the cache budgets
    # must be what keeps two models from fitting: 2 x cache_bytes > budget_one).
    one = max(estimate_footprint(weights_bytes(p), args.cache_bytes) for p in paths.values())
    args.budget_one = args.budget_one or one + 64 * 2**20
    args.budget_both = args.budget_both or 4 * args.budget_one
    if 2 * args.cache_bytes <= args.budget_one:
        print(f"warning: two cache budgets fit in --budget-one ({args.budget_one} bytes): the "
              "models may be measured to fit together", file=sys.stderr)
    texts = conversations(args.turns)
    runs: dict[str, dict] = {}
    for name in args.scenarios:
        print(f"scenario ({name}) {SCENARIOS[name]} ...", flush=True)
        t0 = time.monotonic()
        runs[name] = run_scenario(name, args, paths, texts, deadline)
        print(f"  done in {time.monotonic() - t0:.0f} s", flush=True)
    text = table(runs)
    print(text)
    (args.out / "swap.md").write_text(text + "\n")
    (args.out / "swap.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1))
    plot(runs, args.out / "swap.png")
    print(f"wrote {args.out / 'swap.json'}, swap.md, swap.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
