"""Head of line under memory pressure (issue 47): five short requests sent while three long
answers decode under a small worker cache budget; per short request, time to first token and
total against the same request alone; one server after another (each its own process, 2 cores).

    ./run bench hol_memory                              # tiny qwen3_next, ~2.5 min
    ./run bench hol_memory --models builtin --configs prefixd,prefixd-serial,stock  # ~15 min
    ./run bench hol_memory --configs prefixd,stock --cache-bytes 3145728

Servers (`--configs`): `prefixd`, the worker at its defaults (max_active 64) but a small cache
budget (`--cache-bytes`: PREFIXD_CACHE_BYTES; the live caches within active_kv_share 0.5 of it)
and no disk tier; `prefixd-serial`, the same with PREFIXD_MAX_ACTIVE=1 (one request at a time:
a short one waits for every answer ahead of it, as under a budget before 5393f21, whose code is
not kept to run); `stock`,
`mlx_lm.server` (continuous batching, no budget); `proxy`, `prefixd serve` with one managed mlx
backend whose `worker_env` sets the same budget. Workload: three long answers (~300-token
prompts, `--long-max` tokens) at t=0, five shorts (30-100-token prompts, 8-16 tokens) 1.0, 1.7,
... 3.8 s after the first long answer's first token; distinct content, greedy, streaming.
"Alone": each short and the first long, one after another on a fresh process of the same
server. The budget is such that two long answers' reservations ((prompt + max_tokens + draft) x
KV bytes per token + fixed bytes: `scheduler/sizing.py`, measured by loading the model as the
worker does) do not fit the live budget (printed): 2 MiB on the tiny hybrid (256 B/token: 32
MiB would hold ~30 long answers). Writes bench/out/hol_memory.{md,json}, logs in hol_memory/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interactive import (
    Live,
    Req,
    _git,
    _version,
    _wait_proxy,
    alone,
    builtin_f32,
    send,
    sized,
    start,
    stop,
)
from multiturn import BLAS, OUT, ROOT, ensure_model, free_port, prompt_tokens, stream_chat, warm_up

CONFIGS = ("prefixd", "prefixd-serial", "stock", "proxy")
CACHE_BYTES = {"qwen3_next": 2 * 2**20, "builtin": 32 * 2**20}
LONG_MAX = {"qwen3_next": 3000, "builtin": 400}   # builtin: ~12 tokens/s here
LONG_PROMPT, SHORT_PROMPT, SHORT_MAX = 300, (30, 100), (8, 16)
# SmolLM2 answers these for 400+ tokens (greedy; other wordings end within 10-100 tokens)
LONG_SYSTEMS = ("Comment on each of the following words at great length.",
                "For each of the following words, write a long paragraph about it, one by one.",
                "Comment on every one of these words, one after another, at great length.")
SHORT_SYSTEMS = ("Answer in one line.", "Reply briefly.", "Be concise.",
                 "One sentence only.", "Short answer, please.")
FIRST_AT, APART = 1.0, 0.7   # the shorts' offsets from the first long answer's first token
WAITED = re.compile(r"prompt (\d+) tokens .*waited ([0-9.]+)s for a slot")


def workload(tokenizer: Any, model: str, long_max: int) -> tuple[list[Req], list[Req]]:
    """The three long answers (at t=0, in order) and the five shorts (`at`: from the first
    long answer's first token); seeded, so each server gets the very same requests. Distinct
    system messages too: nothing is shared but the chat template's first tokens."""
    longs = [Req(f"long{i + 1}", "long", sized(tokenizer, LONG_PROMPT, f"hol-long{i}-{model}",
                                               system, long_max), at=0.005 * i)
             for i, system in enumerate(LONG_SYSTEMS)]
    shorts = []
    for i, system in enumerate(SHORT_SYSTEMS):
        n = SHORT_PROMPT[0] + (SHORT_PROMPT[1] - SHORT_PROMPT[0]) * i // (len(SHORT_SYSTEMS) - 1)
        m = SHORT_MAX[0] + (SHORT_MAX[1] - SHORT_MAX[0]) * i // (len(SHORT_SYSTEMS) - 1)
        shorts.append(Req(f"short{i + 1}", "short", sized(
            tokenizer, n, f"hol-short{i}-{model}", system, m), at=FIRST_AT + APART * i))
    return longs, shorts


# --- the live-cache budget, as the worker computes it ------------------------------------------

def measure(model_dir: str, cache_bytes: int) -> dict[str, Any]:
    """The worker's admission rates for `model_dir` (`generator._drive`), from the model loaded
    as the worker loads it. Run in a child process (`--measure`): the bench stays light."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from prefixd.backends.mlx.scheduler.generator import Generator
    from prefixd.backends.mlx.scheduler.sizing import kv_bytes_per_token, request_bytes
    from prefixd.backends.mlx.settings import WorkerSettings

    settings = WorkerSettings(_env_file=None, cache_bytes=cache_bytes, disk_cache_bytes=0)
    gen = Generator(settings)
    with ThreadPoolExecutor(1) as pool:   # as tests/worker_fixtures.loaded
        engine = pool.submit(asyncio.run, gen.load(model_dir)).result().engine
    leaves, spec = engine.reference_leaves(), engine.spec
    width = spec.max_draft + 1 if spec else 1
    return {"budget": int(settings.active_kv_share * engine.config.cache_bytes),
            "active_kv_share": settings.active_kv_share, "cache_bytes": cache_bytes,
            "per_token": kv_bytes_per_token(leaves), "draft": width if spec else 0,
            "per_request": request_bytes(leaves, engine.logits_bytes, width,
                                         bool(spec and spec.leaves))}


def pressure(model_dir: Path, args: argparse.Namespace, longs: list[Req], shorts: list[Req],
             tokenizer: Any) -> dict[str, Any]:
    env = {**os.environ, **({"LD_PRELOAD": BLAS} if Path(BLAS).exists() else {})}
    proc = subprocess.run([sys.executable, __file__, "--measure", str(model_dir),
                           "--cache-bytes", str(args.cache_bytes)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    if proc.returncode:
        raise RuntimeError(f"measuring the budget failed: {proc.stderr[-2000:]}")
    rates = json.loads(proc.stdout.strip().splitlines()[-1])

    def reserve(r: Req) -> int:
        n = len(prompt_tokens(tokenizer, r.body)) + r.body["max_tokens"] + rates["draft"]
        return n * rates["per_token"] + rates["per_request"]

    rates["long"] = max(reserve(r) for r in longs)
    rates["short"] = max(reserve(r) for r in shorts)
    rates["longs_at_once"] = rates["budget"] // rates["long"]
    return rates


# --- one server --------------------------------------------------------------------------------

def launch(config: str, model_dir: Path, args: argparse.Namespace, phase: str) -> Live:
    """`config`'s server, ready and warmed up (`interactive.start`; the proxy: its backend's
    `worker_env` carries the budget)."""
    budget = {"PREFIXD_CACHE_BYTES": str(args.cache_bytes), "PREFIXD_DISK_CACHE_BYTES": "0"}
    if config != "proxy":
        env = budget | ({"PREFIXD_MAX_ACTIVE": "1"} if config == "prefixd-serial" else {})
        return start(config, model_dir, argparse.Namespace(**{**vars(args), "prefixd_env": env}),
                     phase)
    logs = args.out / "interactive-logs" / f"{model_dir.name}-proxy-{phase}"
    logs.mkdir(parents=True, exist_ok=True)
    port, cache_dir = free_port(), tempfile.mkdtemp(prefix="prefixd-bench-cache-")
    backends = [{"name": "mlx", "kind": "mlx", "model": str(model_dir), "worker_env": budget}]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PREFIXD_BACKENDS": json.dumps(backends), "PREFIXD_CACHE_DIR": cache_dir,
                "PREFIXD_REQUEST_TIMEOUT_S": str(args.timeout)})
    with (logs / "proxy.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefixd.proxy.cli", "serve", "--host",
                                 "127.0.0.1", "--port", str(port)], env=env, cwd=cache_dir,
                                stdout=log, stderr=subprocess.STDOUT)
    live = Live("proxy", port, proc, cache_dir=cache_dir)
    threading.Thread(target=live.sample, daemon=True).start()
    try:
        _wait_proxy(live)
        warm_up(argparse.Namespace(port=port), 4)
    except BaseException:
        stop(live)
        raise
    return live


def _send_first(port: int, req: Req, t0: float, timeout: float, first: threading.Event) -> None:
    """`interactive.send` for the first long answer, setting `first` at its first token."""
    req.sent = time.perf_counter() - t0
    try:
        text, usage, ttft, total = stream_chat(port, req.body, timeout, first=first.set)
    except Exception as e:
        req.error, req.total = f"{type(e).__name__}: {e}", time.perf_counter() - t0 - req.sent
        first.set()
        return
    req.text, req.ttft, req.total, req.prefixd = text, ttft, total, usage.get("prefixd")
    req.prompt, req.completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)


def burst(live: Live, longs: list[Req], shorts: list[Req], timeout: float) -> float:
    """The longs at t=0, the shorts at their offsets from the first long's first token; every
    request bounded by `timeout`. Returns that first token's time (s from t=0)."""
    t0, first = time.perf_counter(), threading.Event()
    threads = [_go(_send_first, live.port, longs[0], t0, timeout, first),
               *(_go(send, live.port, r, t0, timeout) for r in longs[1:])]
    first.wait(timeout)
    t1 = time.perf_counter()
    threads += [_go(send, live.port, r, t1, timeout) for r in shorts]
    deadline = time.monotonic() + 3 * timeout
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()))
    for r in shorts:   # on the burst's clock
        r.at, r.sent = r.at + t1 - t0, r.sent + t1 - t0
    return t1 - t0


def _go(fn: Any, *args: Any) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


def waited(log_dir: Path, jobs: int) -> list[tuple[int, float]]:
    """(prompt tokens, the worker's own `waited X s for a slot`) of the burst's `jobs` requests:
    the last lines of its log (the warm-up requests come first)."""
    found = [(int(n), float(w)) for f in sorted(log_dir.rglob("*.log"))
             for n, w in WAITED.findall(f.read_text(errors="replace"))]
    return found[-jobs:]


def run_config(config: str, model_dir: Path, longs: list[Req], shorts: list[Req],
               args: argparse.Namespace) -> dict[str, Any]:
    live = launch(config, model_dir, args, "alone")
    try:   # a fresh process for the burst: nothing the alone runs cached serves it
        solo = {r.label: alone(live, r, args.timeout) for r in [*shorts, longs[0]]}
    finally:
        stop(live)
    live = launch(config, model_dir, args, "burst")
    try:
        first = burst(live, longs, shorts, args.timeout)
    finally:
        stop(live)
    logs = args.out / "interactive-logs" / f"{model_dir.name}-{config}-burst"
    out = {"first_token_s": first, "peak_rss": live.hwm, "load": os.getloadavg()[0],
           "waited": waited(logs, len(longs) + len(shorts)),
           "requests": [_row(r, solo.get(r.label)) for r in [*longs, *shorts]]}
    s = [r for r in out["requests"] if r["role"] == "short"]
    print(f"  {config:15} short TTFT s {[round(r['ttft'], 2) for r in s]} (alone "
          f"{[round(r['alone']['ttft'], 2) for r in s]}); longs' total s "
          f"{[round(r['total'], 1) for r in out['requests'][:3]]}; worker log waited s "
          f"{[w for _, w in out['waited']]}", flush=True)
    return out


def _row(r: Req, a: Req | None) -> dict[str, Any]:
    queue = ((r.prefixd or {}).get("timings_ms") or {}).get("queue")
    return {**r.result(), "max_tokens": r.body["max_tokens"],
            "queue_s": None if queue is None else queue / 1000,
            "alone": None if a is None else {"ttft": a.ttft, "total": a.total, "text": a.text,
                                             "completion": a.completion, "error": a.error}}


# --- tables ------------------------------------------------------------------------------------

def summary_table(model: str, rates: dict[str, Any], by_config: dict[str, Any]) -> str:
    mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
    lines = [f"### {model}", "",
             f"Cache budget {mib(rates['cache_bytes'])}, live budget {mib(rates['budget'])} "
             f"(active_kv_share {rates['active_kv_share']}); KV {rates['per_token']:,} B/token, "
             f"{rates['per_request']:,} B fixed per request, draft {rates['draft']} positions. "
             f"A long answer reserves {mib(rates['long'])} ({rates['long'] / rates['budget']:.0%}"
             f" of the live budget: {rates['longs_at_once']} at once), a short one "
             f"{mib(rates['short'])}.", "",
             "| server | short TTFT s median / max | short total s median / max | vs alone, "
             "median (TTFT / total) | longs' total s (long1 alone) | worker queue wait max s, "
             "shorts / longs (log `waited`) | failed | load, 1 min |", "|---" * 8 + "|"]
    for config, run in by_config.items():
        rows = [r for r in run["requests"] if not r["error"]]
        s, lg = [r for r in rows if r["role"] == "short"], run["requests"][:3]
        tt, tot = [r["ttft"] for r in s], [r["total"] for r in s]
        rt = [r["ttft"] / r["alone"]["ttft"] for r in s if r["alone"]["ttft"]]
        rl = [r["total"] / r["alone"]["total"] for r in s if r["alone"]["total"]]
        q = [_x([r["queue_s"] for r in rs if r["queue_s"] is not None])
             for rs in (s, [r for r in rows if r["role"] == "long"])]
        w = [_x([x for n, x in run["waited"] if (n < LONG_PROMPT // 2) == short])
             for short in (True, False)]
        totals = " / ".join(f"{r['total']:.1f}" for r in lg)
        lines.append(
            f"| {config} | {_m(tt)} / {_x(tt)} | {_m(tot)} / {_x(tot)} | {_m(rt, 'x')} / "
            f"{_m(rl, 'x')} | {totals} ({lg[0]['alone']['total']:.1f}) | {q[0]} / {q[1]} "
            f"({w[0]} / {w[1]}) | {len(run['requests']) - len(rows)} | {run['load']:.1f} |")
    return "\n".join(lines)


def request_table(by_config: dict[str, Any]) -> str:
    configs = list(by_config)
    lines = ["| request | prompt / max_tokens | " + " | ".join(
        f"{c}: sent, TTFT (alone), total (alone) s, tokens" for c in configs) + " |",
        "|---|---|" + "---|" * len(configs)]
    for i, r0 in enumerate(by_config[configs[0]]["requests"]):
        cells = []
        for c in configs:
            r = by_config[c]["requests"][i]
            a = r["alone"] or {"ttft": None, "total": None}
            cells.append("failed" if r["error"] else
                         f"{r['sent']:.2f}, {r['ttft']:.2f} ({_x([a['ttft']])}), "
                         f"{r['total']:.2f} ({_x([a['total']])}), {r['completion']}")
        lines.append(f"| {r0['label']} | {r0['prompt']} / {r0['max_tokens']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def _m(xs: list[float], unit: str = "") -> str:
    return f"{statistics.median(xs):.2f}{unit}" if xs else "-"


def _x(xs: list[float | None]) -> str:
    """The largest (2 decimals), "-" if none."""
    got = [x for x in xs if x is not None]
    return f"{max(got):.2f}" if got else "-"


# --- main --------------------------------------------------------------------------------------

def bench_model(name: str, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    builtin = name == "builtin"
    model_dir = builtin_f32(args) if builtin else ensure_model(name, args.models_dir)
    tokenizer = load_tokenizer(model_dir)
    long_max = args.long_max or LONG_MAX[name]
    rates = pressure(model_dir, args, *workload(tokenizer, model_dir.name, long_max), tokenizer)
    print(f"{name}: long reservation {rates['long']:,} B vs live budget {rates['budget']:,} B "
          f"({rates['longs_at_once']} long answers at once)", flush=True)
    results: dict[str, Any] = {}
    for config in args.configs:
        t0 = time.monotonic()   # the same requests, fresh (`workload` is seeded)
        longs, shorts = workload(tokenizer, model_dir.name, long_max)
        results[config] = run_config(config, model_dir, longs, shorts, args)
        print(f"    {config}: {time.monotonic() - t0:.0f} s", flush=True)
    return model_dir.name, {"pressure": rates, "configs": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3_next",
                   help="comma-separated: tiny architectures (bench/out/models) and/or builtin")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="prefixd, prefixd-serial, stock, proxy")
    p.add_argument("--cache-bytes", type=int, default=None,
                   help="the workers' PREFIXD_CACHE_BYTES (default: 2 MiB tiny, 32 MiB builtin)")
    p.add_argument("--long-max", type=int, default=None,
                   help="the long answers' max_tokens (default: 3000 tiny, 400 builtin)")
    p.add_argument("--timeout", type=float, default=600.0, help="per request (s)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--models-dir", type=Path, default=OUT / "models")
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get(
        "PREFIXD_CACHE_DIR", "~/.cache/prefixd")).expanduser())
    p.add_argument("--measure", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.cache_bytes)), flush=True)
        os._exit(0)
    args.configs, out = args.configs.split(","), args.out
    args.out, args.disk_tier = out / "hol_memory", False
    args.profile = argparse.Namespace(timeout=args.timeout)
    meta = {"command": " ".join(["./run bench hol_memory", *(argv or sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "commit": _git("rev-parse", "--short", "HEAD"), "mlx_lm": _version("mlx-lm"),
            "dirty": _git("status", "--porcelain", "--", "backends").splitlines()}
    t0, cache_arg, results = time.monotonic(), args.cache_bytes, {}
    for name in args.models.split(","):
        args.cache_bytes = cache_arg or CACHE_BYTES.get(name, CACHE_BYTES["qwen3_next"])
        label, results[label] = bench_model(name, args)
    meta["seconds"] = round(time.monotonic() - t0)
    parts = [f"# bench/hol_memory.py ({meta['date']}, {meta['seconds']} s, commit "
             f"{meta['commit']}, mlx-lm {meta['mlx_lm']}; uncommitted: {meta['dirty'] or 'none'})",
             "", f"`{meta['command']}`"]
    for model, got in results.items():
        parts += ["", summary_table(model, got["pressure"], got["configs"]), "",
                  request_table(got["configs"])]
    text = "\n".join(parts) + "\n"
    print(text)
    (out / "hol_memory.md").write_text(text)
    (out / "hol_memory.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {out / 'hol_memory.md'}, {out / 'hol_memory.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
