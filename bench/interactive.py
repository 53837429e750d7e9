"""Nobody waits behind a long prefill (issue 26): short requests beside a long one, per request
time to first token and total against the same request alone, on three servers one after another.

    ./run bench interactive                          # tiny qwen3_next + built-in, ~35 min here
    ./run bench interactive --models qwen3_next      # the tiny hybrid only (3 runs), ~4 min
    ./run bench interactive --quick                  # smoke run: tiny, prompts / 4, ~1 min
    ./run bench interactive --models builtin --configs serial,scheduled    # ~12 min
    ./run bench interactive --report bench/out/interactive.json   # tables again, no run

The built-in model takes ~27 of the 32-35 minutes on 2 CPU cores: an 8K prefill there is ~2
min alone, and stock `mlx_lm.server` needs ~9 min for it with the short requests batched in.

Servers (`--configs`), each its own process, never two at once (2 cores), hit directly:
- `serial`: the prefixd worker with PREFIXD_MAX_ACTIVE=1 (one request to its end, FIFO: the
  behaviour before issue 26);
- `scheduled`: the prefixd worker with PREFIXD_MAX_ACTIVE=4 (one forward pass at a time, least
  remaining prefill first, prefill slices while others wait; slice settings left at their
  defaults);
- `stock`: `mlx_lm.server` of the installed mlx-lm (0.32: continuous batching, a new request
  joins the running prompt batch at its next 2,048-token step, decodes are batched);
- `proxy` (only with `--configs ...,proxy`): `prefixd serve` with one managed mlx backend of
  `max_concurrency` 4 (so its worker runs with max_active 4), requests through the proxy.
Both prefixd configurations run without the disk tier (PREFIXD_DISK_CACHE_BYTES=0; `--disk-tier`
keeps it), so a background write of an idle entry never lands inside a measurement.

Scenarios (`--scenarios`):
(a) a long prompt (8,000 tokens on the tiny hybrid; 7,900 + 64 generated on the built-in model,
    whose window is 8,192) sent at t=0; 6 short requests (30-100-token prompts, 16 tokens each)
    arrive at seeded random times: 4 during its prefill, 2 during its decode. The times are
    fractions of each server's own long-alone prefill and decode, the same fractions for all.
(b) an agent burst: a long main turn (8,000 tokens tiny, 3,000 built-in), a title call (~60
    tokens) and three sub-agent first turns (1,000 / 1,500 / 2,000 tokens tiny, 500 / 750 /
    1,000 built-in) sent together; when all are answered, the follow-ups of the main turn and
    of the sub-agents (reply + ~200 new user tokens each; the title call has none) together.
Every prompt's content is distinct (seeded words), so nothing is shared between requests but
the chat template's first tokens. Everything runs `--repeats` times (3) on tiny models, the
configurations interleaved within each run, and `--builtin-repeats` times (1) on the built-in
one; medians and p95s pool the short requests of all runs.

"Alone": per server configuration, a fresh server process runs each request of a scenario by
itself, one after another (each cold: distinct content; a follow-up right after its own first
turn, so it is warm as in the burst). Each scenario then runs on another fresh process, whose
peak RSS (VmHWM, and RSS sampled every 50 ms) is the scenario's. Greedy decoding everywhere;
replies are compared with the serial worker's. The prefixd rows also give the long request's
prefill passes (`usage.prefixd.prefill_segments`): "slice" is the median time of its passes
shorter than a chunk, taken while others were under way (its whole-chunk passes when a slice is
a whole chunk), "passes alone" the median time of its prefill passes when it ran alone. A
short request in (a) is one of the six; in (b), the title call (the sub-agent turns and
follow-ups are reported apart).

The built-in model (SmolLM2-135M-Instruct) is the worker's own built-in conversion, dequantized
to float32 as the worker does on a CPU, written once to bench/out/models/ so stock
`mlx_lm.server` serves the very same weights. Writes bench/out/interactive.json,
bench/out/interactive.md and bench/out/interactive_<model>.png (a timeline per scenario and
server); results in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multiturn import (
    BLAS,
    OUT,
    ROOT,
    Server,
    end_process,
    ensure_model,
    free_port,
    get_json,
    prompt_tokens,
    start_server,
    stop_server,
    stream_chat,
    wait_ready,
    warm_up,
)
from workloads import words

BUILTIN = "smollm2-135m-instruct"
MODELS = ("qwen3_next", "builtin")
CONFIGS = ("serial", "scheduled", "stock")
SCHEDULED_ACTIVE = 4
SAMPLE_S = 0.05  # RSS sampling period
SHORT_ROLES = ("short", "title")  # the short requests of the TTFT targets
MIN_PASS = 32  # prefill passes shorter than this are a prompt's tail, not a slice


@dataclass(frozen=True)
class Profile:
    """Request sizes (prompt tokens) for one model."""

    long: int            # (a) the long prompt
    long_max: int        # (a) its max_tokens (its decode phase)
    short: tuple[int, int] = (30, 100)
    short_max: int = 16
    shorts_prefill: int = 4  # (a) shorts arriving during the long prefill
    shorts_decode: int = 2   # ... and during its decode
    main: int = 8000     # (b) the main turn
    title: int = 60
    subs: tuple[int, ...] = (1000, 1500, 2000)
    turn_max: int = 64   # (b) max_tokens of main and sub-agent turns
    title_max: int = 16
    follow: int = 200    # (b) new user tokens of a follow-up
    timeout: float = 300.0  # per request (socket timeout)

    def scaled(self, f: float) -> Profile:
        n = lambda x: max(16, round(x * f))  # noqa: E731
        return Profile(n(self.long), self.long_max, self.short, self.short_max,
                       self.shorts_prefill, self.shorts_decode, n(self.main), self.title,
                       tuple(n(s) for s in self.subs), self.turn_max, self.title_max,
                       n(self.follow), self.timeout)


TINY = Profile(long=8000, long_max=256)
# SmolLM2's window is 8,192 tokens, prompt and reply together; an 8K prefill takes ~2-3 min
# on 2 CPU cores (its attention dominates at that length), so (b) is smaller there.
BUILTIN_PROFILE = Profile(long=7900, long_max=64, main=3000, subs=(500, 750, 1000),
                          turn_max=32, follow=150, timeout=1500.0)


@dataclass
class Req:
    """One request of a scenario: its body, when it is sent, and what came back."""

    label: str
    role: str  # long | short | main | title | sub | follow
    body: dict[str, Any]
    at: float = 0.0  # offset from the scenario start (s)
    # filled by `send`
    sent: float = 0.0
    ttft: float = 0.0
    total: float = 0.0
    text: str = ""
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    prefixd: dict[str, Any] | None = None
    error: str | None = None

    def result(self) -> dict[str, Any]:
        return {"label": self.label, "role": self.role, "at": round(self.at, 4),
                "sent": round(self.sent, 4), "ttft": self.ttft, "total": self.total,
                "prompt": self.prompt, "cached": self.cached, "completion": self.completion,
                "text": self.text, "error": self.error,
                "prefixd": _lean(self.prefixd)}


def _lean(p: dict[str, Any] | None) -> dict[str, Any] | None:
    if not p:
        return None
    return {k: p[k] for k in ("timings_ms", "prefill_segments", "prefill_yields",
                              "cached_tokens", "recomputed_tokens") if k in p}


# --- request content -------------------------------------------------------------------------

def _body(messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def sized(tokenizer: Any, target: int, seed: str, system: str, max_tokens: int
          ) -> dict[str, Any]:
    """A body whose chat-templated prompt is about `target` tokens: a system message and a
    user message of seeded words (prefix-stable, so resizing only cuts or extends the end)."""
    n, body = max(8, target - 20), {}
    for _ in range(6):
        text = words(random.Random(seed), n)
        body = _body([{"role": "system", "content": system},
                      {"role": "user", "content": text}], max_tokens)
        got = len(prompt_tokens(tokenizer, body))
        if abs(got - target) <= max(2, target // 400):
            break
        n = max(8, n + round((target - got) * n / max(got, 1)))
    return body


def followup(first: Req, reply: str, tokenizer: Any, new: int, seed: str) -> dict[str, Any]:
    """The next turn of `first`'s conversation: its reply and ~`new` user tokens appended."""
    messages = [*first.body["messages"], {"role": "assistant", "content": reply}]
    tail = sized(tokenizer, new + 12, seed, "", 1)["messages"][1]["content"]
    return _body([*messages, {"role": "user", "content": tail}], first.body["max_tokens"])


def scenario_a(tokenizer: Any, p: Profile, model: str) -> list[Req]:
    rng = random.Random(f"interactive-a-{model}")
    reqs = [Req("long", "long", sized(tokenizer, p.long, f"a-long-{model}",
                                      "You summarize long documents.", p.long_max))]
    for i in range(p.shorts_prefill + p.shorts_decode):
        n = rng.randint(*p.short)
        reqs.append(Req(f"short{i + 1}", "short",
                        sized(tokenizer, n, f"a-short{i}-{model}", "Answer briefly.",
                              p.short_max)))
    return reqs


def arrivals(p: Profile, model: str) -> list[tuple[str, float]]:
    """(phase, fraction of that phase) for each short of (a), in arrival order; the same
    fractions for every server, each mapped onto its own long-alone prefill and decode."""
    rng = random.Random(f"interactive-arrivals-{model}")
    during = sorted(rng.uniform(0.05, 0.95) for _ in range(p.shorts_prefill))
    after = sorted(rng.uniform(0.05, 0.85) for _ in range(p.shorts_decode))
    return [("prefill", f) for f in during] + [("decode", f) for f in after]


def scenario_b(tokenizer: Any, p: Profile, model: str) -> list[Req]:
    reqs = [Req("main", "main", sized(tokenizer, p.main, f"b-main-{model}",
                                      "You are a coding agent.", p.turn_max)),
            Req("title", "title", sized(tokenizer, p.title, f"b-title-{model}",
                                        "Write a 5-word title for this conversation.",
                                        p.title_max))]
    for i, n in enumerate(p.subs):
        reqs.append(Req(f"sub{i + 1}", "sub", sized(
            tokenizer, n, f"b-sub{i}-{model}", f"You are sub-agent {i + 1}: explore the code.",
            p.turn_max)))
    for i, r in enumerate(reqs):
        r.at = 0.005 * i  # together, in a fixed order
    return reqs


# --- servers ---------------------------------------------------------------------------------

@dataclass
class Live:
    """A started server (worker, stock or proxy) and its RSS, sampled every 50 ms."""

    config: str
    port: int
    proc: subprocess.Popen[bytes]
    server: Server | None = None  # a worker or stock server (multiturn's)
    cache_dir: str | None = None  # the proxy's
    peak_sampled: int = 0
    hwm: int = 0
    ready_rss: int = 0
    samples: list[tuple[float, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    t0: float = 0.0

    def rss(self) -> int:
        """The server's RSS (the proxy's: its worker, where the model and caches are)."""
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(self.proc.pid)
            if self.config == "proxy":
                kids = proc.children(recursive=True)
                return max((k.memory_info().rss for k in kids), default=0)
            return int(proc.memory_info().rss)
        return 0

    def sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            now = self.rss()
            self.peak_sampled = max(self.peak_sampled, now)
            if self.t0:
                self.samples.append((time.perf_counter() - self.t0, now))

    def read_hwm(self) -> None:
        pids = [self.proc.pid]
        if self.config == "proxy":
            with contextlib.suppress(psutil.Error):
                pids = [k.pid for k in psutil.Process(self.proc.pid).children(recursive=True)]
        for pid in pids:
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.hwm = max(self.hwm, int(line.split()[1]) * 1024)


def prefixd_env(config: str, args: argparse.Namespace) -> dict[str, str]:
    env = {} if args.disk_tier else {"PREFIXD_DISK_CACHE_BYTES": "0"}
    if config == "serial":
        env["PREFIXD_MAX_ACTIVE"] = "1"
    elif config == "scheduled":
        env["PREFIXD_MAX_ACTIVE"] = str(SCHEDULED_ACTIVE)
    return env | args.prefixd_env


def start(config: str, model_dir: Path, args: argparse.Namespace, phase: str) -> Live:
    logs = args.out / "interactive-logs" / f"{model_dir.name}-{config}-{phase}"
    if config == "proxy":
        live = _start_proxy(model_dir, args, logs)
    else:
        ns = argparse.Namespace(prefixd_env=prefixd_env(config, args), kv_bits=None, out=logs)
        server = start_server("stock" if config == "stock" else "prefixd", model_dir, ns)
        server._stop.set()  # our own sampler below (50 ms, and a trace for the plot)
        live = Live(config, server.port, server.proc, server=server)
    threading.Thread(target=live.sample, daemon=True).start()
    try:
        if live.server is not None:
            wait_ready(live.server)
        else:
            _wait_proxy(live)
        warm_up(_as_server(live), 4)
        # A longer unrelated prompt too: the first passes of each chunk shape are slower
        # (restart.py does the same), and they should not be billed to the first request.
        stream_chat(live.port, _body([{"role": "user", "content": "warm " * 600}], 4),
                    timeout=args.profile.timeout)
    except BaseException:
        stop(live)
        raise
    live.ready_rss = live.rss()
    return live


def _as_server(live: Live) -> Any:
    return live.server or argparse.Namespace(port=live.port)


def _start_proxy(model_dir: Path, args: argparse.Namespace, logs: Path) -> Live:
    port = free_port()
    cache_dir = tempfile.mkdtemp(prefix="prefixd-bench-cache-")
    backends = [{"name": "mlx", "kind": "mlx", "model": str(model_dir),
                 "max_concurrency": SCHEDULED_ACTIVE}]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PREFIXD_BACKENDS": json.dumps(backends), "PREFIXD_CACHE_DIR": cache_dir,
                "PREFIXD_REQUEST_TIMEOUT_S": str(args.profile.timeout)})
    env.update(prefixd_env("proxy", args))
    if Path(BLAS).exists():
        env["LD_PRELOAD"] = BLAS
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / "proxy.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefixd.proxy.cli", "serve",
                                 "--host", "127.0.0.1", "--port", str(port)],
                                env=env, cwd=tempfile.gettempdir(), stdout=log,
                                stderr=subprocess.STDOUT)
    return Live("proxy", port, proc, cache_dir=cache_dir)


def _wait_proxy(live: Live) -> None:
    deadline = time.monotonic() + 180
    body = _body([{"role": "user", "content": "ready?"}], 1)
    while time.monotonic() < deadline:
        if live.proc.poll() is not None:
            raise RuntimeError(f"prefixd serve exited with {live.proc.returncode}")
        with contextlib.suppress(Exception):
            stream_chat(live.port, body, timeout=30)
            return
        time.sleep(0.5)  # the managed worker loads its model; no event to wait on
    raise TimeoutError("prefixd serve not answering after 180 s")


def stop(live: Live) -> None:
    live.read_hwm()
    live._stop.set()
    if live.server is not None:
        stop_server(live.server)
        return
    end_process(live.proc, 30)  # the proxy stops its worker
    if live.cache_dir:
        shutil.rmtree(live.cache_dir, ignore_errors=True)


# --- sending ---------------------------------------------------------------------------------

def send(port: int, req: Req, t0: float, timeout: float) -> None:
    """Wait until `req.at` after `t0`, send it streaming, fill its results (never raises)."""
    delay = t0 + req.at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    req.sent = time.perf_counter() - t0
    try:
        text, usage, ttft, total = stream_chat(port, req.body, timeout=timeout)
    except Exception as e:  # a failed request is a result too
        req.error, req.total = f"{type(e).__name__}: {e}", time.perf_counter() - t0 - req.sent
        return
    req.text, req.ttft, req.total = text, ttft, total
    req.prompt = int(usage.get("prompt_tokens", 0))
    req.completion = int(usage.get("completion_tokens", 0))
    req.cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    req.prefixd = usage.get("prefixd")


def fire(live: Live, reqs: list[Req], timeout: float) -> None:
    """Send `reqs` at their offsets, concurrently; return when all are answered."""
    t0 = time.perf_counter()
    live.t0 = live.t0 or t0
    base = t0 - live.t0
    threads = [threading.Thread(target=send, args=(live.port, r, t0, timeout), daemon=True)
               for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + max(r.at for r in reqs) + 30)
    for r in reqs:  # on the scenario's clock (a second burst follows the first)
        r.at, r.sent = r.at + base, r.sent + base


def alone(live: Live, req: Req, timeout: float) -> Req:
    copy = Req(req.label, req.role, req.body)
    send(live.port, copy, time.perf_counter(), timeout)
    return copy


# --- one model, one configuration ------------------------------------------------------------

def run_a(config: str, model_dir: Path, tokenizer: Any, args: argparse.Namespace
          ) -> dict[str, Any]:
    p, model = args.profile, model_dir.name
    reqs = scenario_a(tokenizer, p, model)
    live = start(config, model_dir, args, "a-alone")
    try:  # shorts first: the long one's large cache entry is not there while they run
        solo = {r.label: alone(live, r, p.timeout) for r in reqs[1:]}
        solo["long"] = alone(live, reqs[0], p.timeout)
    finally:
        stop(live)
    long_solo = solo["long"]
    prefill, decode = long_solo.ttft, max(long_solo.total - long_solo.ttft, 0.0)
    for r, (phase, f) in zip(reqs[1:], arrivals(p, model), strict=True):
        r.at = f * prefill if phase == "prefill" else prefill + f * decode
    live = start(config, model_dir, args, "a")
    try:
        fire(live, reqs, p.timeout)
        cache = get_json(live.port, "/v1/cache") if config != "stock" else {}
    finally:
        stop(live)
    print(f"  {model:24} {config:9} (a) long alone {long_solo.ttft:7.2f} / "
          f"{long_solo.total:7.2f} s, with shorts {reqs[0].ttft:7.2f} / {reqs[0].total:7.2f} s; "
          f"short TTFT ms {[round(r.ttft * 1000) for r in reqs[1:]]} (alone "
          f"{[round(solo[r.label].ttft * 1000) for r in reqs[1:]]}); peak "
          f"{live.hwm / 2**20:.0f} MiB", flush=True)
    return _outcome(live, reqs, solo, cache)


def run_b(config: str, model_dir: Path, tokenizer: Any, args: argparse.Namespace
          ) -> dict[str, Any]:
    p, model = args.profile, model_dir.name
    firsts = scenario_b(tokenizer, p, model)
    solo: dict[str, Req] = {}
    live = start(config, model_dir, args, "b-alone")
    try:  # each conversation alone: its first turn, then its follow-up (warm from it)
        for r in [*firsts[1:], firsts[0]]:
            solo[r.label] = alone(live, r, p.timeout)
            if r.role != "title":
                nxt = Req(f"{r.label}+1", "follow", followup(
                    r, solo[r.label].text, tokenizer, p.follow, f"b-follow-{r.label}-{model}"))
                solo[nxt.label] = alone(live, nxt, p.timeout)
    finally:
        stop(live)
    live = start(config, model_dir, args, "b")
    try:
        fire(live, firsts, p.timeout)
        follows = [Req(f"{r.label}+1", "follow", followup(
            r, r.text, tokenizer, p.follow, f"b-follow-{r.label}-{model}"))
            for r in firsts if r.role != "title"]
        for i, r in enumerate(follows):
            r.at = 0.005 * i
        fire(live, follows, p.timeout)
        cache = get_json(live.port, "/v1/cache") if config != "stock" else {}
    finally:
        stop(live)
    reqs = firsts + follows
    print(f"  {model:24} {config:9} (b) TTFT ms "
          f"{[(r.label, round(r.ttft * 1000)) for r in reqs]} alone "
          f"{[round(solo[r.label].ttft * 1000) for r in reqs]}; peak "
          f"{live.hwm / 2**20:.0f} MiB", flush=True)
    return _outcome(live, reqs, solo, cache)


def _outcome(live: Any, reqs: list[Req], solo: dict[str, Req],
             cache: dict[str, Any]) -> dict[str, Any]:
    """A scenario's record: every request against itself alone, the server's memory."""
    return {"requests": [_row(r, solo[r.label]) for r in reqs], "peak_rss": live.hwm,
            "peak_rss_sampled": live.peak_sampled, "ready_rss": live.ready_rss,
            "rss": _thin(live.samples), "cache_entries": _entries(cache),
            "load": os.getloadavg()[0]}


def _row(r: Req, a: Req) -> dict[str, Any]:
    row = r.result()
    row["alone"] = {"ttft": a.ttft, "total": a.total, "prompt": a.prompt, "cached": a.cached,
                    "completion": a.completion, "text": a.text, "error": a.error,
                    "prefixd": _lean(a.prefixd)}
    return row


def _thin(samples: list[tuple[float, int]]) -> list[tuple[float, int]]:
    step = max(1, len(samples) // 400)
    return [(round(t, 3), n) for t, n in samples[::step]]


def _entries(cache: dict[str, Any]) -> list[dict[str, int]]:
    return [{"tokens": e["tokens"], "bytes": e["bytes"] + e.get("checkpoint_bytes", 0)}
            for e in cache.get("entries", []) if isinstance(e, dict)]


# --- summary ---------------------------------------------------------------------------------

def quantile(xs: list[float], q: float) -> float:
    """Linear interpolation between order statistics (with 6 values, p95 is near the max)."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def long_passes(row: dict[str, Any]) -> list[tuple[int, float]]:
    """(tokens, ms) of each prefill pass of at least MIN_PASS tokens but the last, from the
    worker's prefill_segments (empty for stock)."""
    segs = ((row.get("prefixd") or {}).get("prefill_segments") or [])[:-1]
    return [(s["tokens"], s["ms"]) for s in segs if s["tokens"] >= MIN_PASS]


def slice_passes(passes: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The long request's slices: its passes shorter than a whole chunk (taken while others
    were under way); none when a slice is a whole chunk (then every pass is one)."""
    chunk = max((t for t, _ in passes), default=0)
    body = passes[:-1]  # the last is the prompt's remainder, whatever the slicing
    return [p for p in body if p[0] < chunk] or [p for p in body if p[0] == chunk]


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per model, scenario and server configuration, pooled over the runs: every
    short request of every run counts once in the medians and p95s."""
    out = []
    for model, by_scenario in results.items():
        for scenario, by_config in by_scenario.items():
            serial = by_config.get("serial")
            for config, runs in by_config.items():
                big = "long" if scenario == "a" else "main"
                line: dict[str, Any] = {"model": model, "scenario": scenario, "config": config,
                                        "runs": len(runs)}
                ratio, extra, longs, slices, chunks, peaks = [], [], [], [], [], []
                o_ratio, o_extra = [], []
                same = n = alone_same = failed = 0
                differ: list[str] = []
                others_work, floors, yields = [], [], []
                for i, run in enumerate(runs):
                    rows = [r for r in run["requests"] if not r["error"]]
                    failed += len(run["requests"]) - len(rows)
                    peaks.append(run["peak_rss"])
                    for r in rows:  # short requests; (b)'s sub-agents and follow-ups apart
                        if r["role"] in ("long", "main") or not r["alone"]["ttft"]:
                            continue
                        short = r["role"] in SHORT_ROLES
                        (ratio if short else o_ratio).append(r["ttft"] / r["alone"]["ttft"])
                        (extra if short else o_extra).append(
                            (r["ttft"] - r["alone"]["ttft"]) * 1000)
                    lr = next((r for r in rows if r["label"] == big), None)
                    if lr is not None:
                        longs.append(lr["total"] / lr["alone"]["total"])
                        if config not in ("serial", "stock"):
                            slices += slice_passes(long_passes(lr))
                        chunks += long_passes({"prefixd": lr["alone"]["prefixd"]})
                        others_work.append(sum(r["alone"]["total"] for r in rows
                                               if r["role"] in ("short", "title", "sub")))
                        # one pass at a time: the long one ends no sooner than its own time
                        # alone plus the others' work that runs before its end
                        floors.append(1 + others_work[-1] / lr["alone"]["total"])
                        yields.append((lr.get("prefixd") or {}).get("prefill_yields", 0))
                    alone_same += sum(r["text"] == r["alone"]["text"] for r in rows)
                    if serial is not None and i < len(serial):
                        ref = {r["label"]: r["text"] for r in serial[i]["requests"]}
                        for r in rows:
                            n += 1
                            if ref.get(r["label"]) == r["text"]:
                                same += 1
                            else:
                                differ.append(f"{r['label']}#{i}")
                line.update({
                    "failed": failed,
                    "shorts": len(ratio),
                    "ttft_ratio_median": statistics.median(ratio) if ratio else None,
                    "ttft_ratio_p95": quantile(ratio, 0.95),
                    "ttft_extra_ms_median": statistics.median(extra) if extra else None,
                    "ttft_extra_ms_p95": quantile(extra, 0.95),
                    "others": len(o_ratio),
                    "others_ratio_median": statistics.median(o_ratio) if o_ratio else None,
                    "others_ratio_p95": quantile(o_ratio, 0.95),
                    "others_extra_ms_median": statistics.median(o_extra) if o_extra else None,
                    "others_extra_ms_p95": quantile(o_extra, 0.95),
                    "peak_rss": statistics.median(peaks), "peak_rss_max": max(peaks),
                    "peak_rss_min": min(peaks), "alone_same": alone_same})
                if longs:
                    line["long_ratio"] = statistics.median(longs)
                    line["long_ratios"] = longs
                if slices:
                    line["slice_ms"] = statistics.median(ms for _, ms in slices)
                    line["slice_tokens"] = statistics.median(t for t, _ in slices)
                if chunks:
                    line["chunk_ms"] = statistics.median(ms for _, ms in chunks)
                    line["chunk_tokens"] = max(t for t, _ in chunks)
                if others_work:  # what the others' own work alone adds to the long's
                    line["others_alone_s"] = statistics.median(others_work)
                    line["long_floor"] = statistics.median(floors)
                    line["long_yields"] = statistics.median(yields)
                if serial is not None:
                    line["replies_same"], line["replies_n"] = same, n
                    line["replies_differ"] = differ
                if serial is not None and config != "serial":
                    own = statistics.median(
                        sum(e["bytes"] for e in run["cache_entries"]
                            if e["tokens"] <= _short_bound(run["requests"])) for run in runs)
                    line["short_cache_bytes"] = own
                    serial_peak = statistics.median(r["peak_rss"] for r in serial)
                    line["rss_allowance"] = serial_peak + own
                    line["rss_vs_serial"] = line["peak_rss"] - serial_peak
                out.append(line)
    return out


def _short_bound(rows: list[dict[str, Any]]) -> int:
    """Tokens an entry of a short request (or title, sub-agent turn) holds at most."""
    small = [r["prompt"] + r["completion"] for r in rows
             if r["role"] in ("short", "title", "sub")]
    return max(small, default=0) + 8


def verdicts(summary: list[dict[str, Any]]) -> list[str]:
    """Issue 26's targets, for the scheduled worker, per model and scenario."""
    out = []
    for s in summary:
        if s["config"] != "scheduled":
            continue
        slice_ms = s.get("slice_ms")
        p95 = s["ttft_extra_ms_p95"]
        checks = [
            ("short TTFT p95 <= alone + one slice",
             slice_ms is not None and p95 <= slice_ms,
             f"p95 of TTFT - alone {p95:.0f} ms over {s['shorts']} requests, one slice "
             f"{'n/a' if slice_ms is None else f'{slice_ms:.0f}'} ms "
             f"({_f(s.get('slice_tokens'), '.0f')} tokens)"),
            ("short TTFT median <= 2x alone", s["ttft_ratio_median"] <= 2.0,
             f"median {s['ttft_ratio_median']:.2f}x"),
        ]
        if "long_ratio" in s:
            ratios = ", ".join(f"{x:.3f}" for x in s["long_ratios"])
            if s["scenario"] == "a":
                checks.append(("long total <= 1.10x alone", s["long_ratio"] <= 1.10,
                               f"median {s['long_ratio']:.3f}x (runs: {ratios}); the shorts' "
                               f"own time alone: {s['others_alone_s']:.2f} s, so with one pass "
                               f"at a time no less than {s['long_floor']:.3f}x; its passes "
                               f"paused {s['long_yields']:.0f} times for a newcomer"))
            else:
                out.append(f"- {s['model']} (b): the main turn's total / alone, for information "
                           f"(it shares the device with the title and sub-agent turns, "
                           f"{s['others_alone_s']:.1f} s of work alone): median "
                           f"{s['long_ratio']:.3f}x (runs: {ratios}); the sub-agent turns' and "
                           f"follow-ups' TTFT / alone: median "
                           f"{_f(s['others_ratio_median'])}x, p95 {_f(s['others_ratio_p95'])}x")
        if "rss_allowance" in s:
            checks.append(("peak RSS <= serial's + the shorts' cache",
                           s["peak_rss"] <= s["rss_allowance"],
                           f"{_mib(s['peak_rss'])} vs {_mib(s['rss_allowance'])} MiB "
                           f"(serial's + {s['short_cache_bytes'] / 2**20:.2f} MiB; "
                           f"difference {s['rss_vs_serial'] / 2**20:+.1f} MiB)"))
        if "replies_same" in s:
            checks.append(("greedy replies identical to serial",
                           s["replies_same"] == s["replies_n"],
                           f"{s['replies_same']}/{s['replies_n']}"))
        for name, ok, detail in checks:
            out.append(f"- {s['model']} ({s['scenario']}): {name}: "
                       f"**{'met' if ok else 'not met'}** ({detail})")
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None or x != x else format(x, fmt)


def _med(runs: list[dict[str, Any]], i: int, *keys: str) -> float:
    vals = []
    for run in runs:
        v: Any = run["requests"][i]
        for k in keys:
            v = v[k]
        vals.append(v)
    return statistics.median(vals)


def request_table(results: dict[str, Any], model: str, scenario: str) -> str:
    """Per request: each server's TTFT and total against alone (medians over the runs)."""
    by_config = results[model][scenario]
    configs = list(by_config)
    head = ("| request | prompt | arrives s | " + " | ".join(
        f"{c}: TTFT s (alone) | {c}: total s (alone)" for c in configs) + " |")
    lines = [head, "|---|---|---|" + "---|---|" * len(configs)]
    first = by_config[configs[0]][0]["requests"]
    for i, r0 in enumerate(first):
        cells = []
        for c in configs:
            runs = [run for run in by_config[c] if not run["requests"][i]["error"]]
            if not runs:
                cells += ["failed", "failed"]
                continue
            cells += [f"{_med(runs, i, 'ttft'):.3f} ({_med(runs, i, 'alone', 'ttft'):.3f})",
                      f"{_med(runs, i, 'total'):.3f} ({_med(runs, i, 'alone', 'total'):.3f})"]
        arrive = " / ".join(f"{_med(by_config[c], i, 'sent'):.2f}" for c in configs)
        lines.append(f"| {r0['label']} | {r0['prompt'] or r0['alone']['prompt']} | {arrive} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_table(summary: list[dict[str, Any]]) -> str:
    head = ("| model | scenario | server | runs | short TTFT / alone: median, p95 | short TTFT "
            "- alone ms: median, p95 | long's slice ms (its passes alone) | long total / alone | "
            "peak RSS MiB | replies = serial (= alone) |\n" + "|---" * 10 + "|")
    lines = [head]
    for s in summary:
        replies = (f"{s['replies_same']}/{s['replies_n']}" if "replies_same" in s else "-")
        lines.append(
            f"| {s['model']} | ({s['scenario']}) | {s['config']} | {s['runs']} | "
            f"{_f(s['ttft_ratio_median'])}x, {_f(s['ttft_ratio_p95'])}x | "
            f"{_f(s['ttft_extra_ms_median'], '.0f')}, {_f(s['ttft_extra_ms_p95'], '.0f')} | "
            f"{_f(s.get('slice_ms'), '.0f')} ({_f(s.get('chunk_ms'), '.0f')}) | "
            f"{_f(s.get('long_ratio'), '.3f')} | {_mib(s['peak_rss'])} | "
            f"{replies} ({s['alone_same']}) |")
    return "\n".join(lines)


# --- the timeline ----------------------------------------------------------------------------

def plot(results: dict[str, Any], model: str, path: Path) -> None:
    """Per scenario (columns) and server (rows): a bar per request from its arrival to its
    first token (light) and on to its end (dark); a tick where its first token came alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(results[model])
    configs = list(results[model][scenarios[0]])
    fig, axes = plt.subplots(len(configs), len(scenarios), figsize=(6.2 * len(scenarios),
                             1.0 + 1.9 * len(configs)), squeeze=False)
    colors = {"long": "tab:blue", "main": "tab:blue", "short": "tab:orange",
              "title": "tab:orange", "sub": "tab:green", "follow": "tab:purple"}
    for col, scenario in enumerate(scenarios):
        ends = {c: max(r["sent"] + r["total"] for r in results[model][scenario][c][0]["requests"])
                for c in configs}
        shared = max(v for c, v in ends.items() if c != "stock") if len(ends) > 1 else \
            max(ends.values())
        if ends.get("stock", 0) <= 1.5 * shared:
            shared = max(ends.values())
        for row, config in enumerate(configs):
            ax = axes[row][col]
            reqs = results[model][scenario][config][0]["requests"]
            for i, r in enumerate(reqs):
                color = colors[r["role"]]
                ax.barh(i, r["ttft"], left=r["sent"], color=color, alpha=0.35, height=0.7)
                ax.barh(i, r["total"] - r["ttft"], left=r["sent"] + r["ttft"], color=color,
                        height=0.7)
                ax.plot([r["sent"] + r["alone"]["ttft"]] * 2, [i - 0.4, i + 0.4], color="k",
                        linewidth=1)
            ax.set_yticks(range(len(reqs)), [r["label"] for r in reqs], fontsize=7)
            ax.invert_yaxis()
            own = ends[config] > 1.5 * shared  # stock far slower: its own time axis
            ax.set_xlim(0, (ends[config] if own else shared) * 1.02)
            ax.set_title(f"({scenario}) {config}" + (" (its own time axis)" if own else ""),
                         fontsize=9)
            ax.tick_params(axis="x", labelsize=7)
            if row == len(configs) - 1:
                ax.set_xlabel("seconds from the scenario start", fontsize=8)
    fig.suptitle(f"{model} (first run): light = arrival to first token, dark = decoding, "
                 f"| = first token when alone", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


# --- models and main -------------------------------------------------------------------------

def builtin_f32(args: argparse.Namespace) -> Path:
    """The built-in model as the worker serves it on a CPU (float32), as a folder both servers
    load: converted from its wheel once (provision.ensure_builtin), dequantized once."""
    target = args.models_dir / f"{BUILTIN}-f32"
    if (target / "model.safetensors").exists():
        return target
    import gc

    from mlx_lm.utils import save_model

    from prefixd.backends.mlx.model.provision import ensure_builtin, load_model

    src = ensure_builtin(BUILTIN, args.cache_dir)
    model, _ = load_model(str(src), args.cache_dir, dequantize=True)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp / name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(target)
    del model
    gc.collect()
    return target


def bench_model(name: str, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """Every scenario on every server configuration, `repeats` times; the configurations
    interleaved within each run, so a change of load on the machine hits them alike."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    builtin = name == "builtin"
    model_dir = builtin_f32(args) if builtin else ensure_model(name, args.models_dir)
    args.profile = BUILTIN_PROFILE if builtin else TINY
    if args.quick:
        args.profile = args.profile.scaled(0.25)
    repeats = args.builtin_repeats if builtin else args.repeats
    tokenizer = load_tokenizer(model_dir)
    out: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {c: [] for c in args.configs} for s in args.scenarios}
    for rep in range(repeats):
        for scenario in args.scenarios:
            run = run_a if scenario == "a" else run_b
            for config in args.configs:
                t0 = time.monotonic()
                out[scenario][config].append(run(config, model_dir, tokenizer, args))
                print(f"    run {rep + 1}/{repeats} ({scenario}) {config}: "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
    return ("smollm2-135m" if builtin else name), out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help="comma-separated tiny architectures "
                   f"(bench/out/models) and/or 'builtin' (default: {','.join(MODELS)})")
    p.add_argument("--scenarios", default="ab")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="serial, scheduled, stock, proxy (serial first: replies compare to it)")
    p.add_argument("--repeats", type=int, default=3, help="runs of everything, tiny models")
    p.add_argument("--builtin-repeats", type=int, default=1,
                   help="runs of everything, the built-in model (an 8K prefill: ~2.5 min)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: prompts / 4, one run, the tiny hybrid unless --models")
    p.add_argument("--disk-tier", action="store_true", help="keep the workers' disk tier")
    p.add_argument("--prefixd-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the prefixd workers (repeatable)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--models-dir", type=Path, default=OUT / "models")
    p.add_argument("--cache-dir", type=Path,
                   default=Path(os.environ.get("PREFIXD_CACHE_DIR", "~/.cache/prefixd"))
                   .expanduser(), help="where the built-in model is converted (as the worker's)")
    p.add_argument("--img", type=Path, default=None,
                   help="also copy the timelines here (e.g. docs/img)")
    p.add_argument("--report", nargs="+", metavar="JSON",
                   help="no run: tables and timelines from saved interactive.json files")
    args = p.parse_args(argv)
    args.models = args.models or ("qwen3_next" if args.quick else ",".join(MODELS))
    if args.quick:
        args.repeats = args.builtin_repeats = 1
    args.configs = args.configs.split(",")
    args.prefixd_env = dict(kv.split("=", 1) for kv in args.prefixd_env)
    if args.report:
        return report(args)
    t0, commit = time.monotonic(), _git("rev-parse", "HEAD")
    results: dict[str, Any] = {}
    for name in args.models.split(","):
        print(f"{name}:", flush=True)
        label, results[label] = bench_model(name, args)
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
            if k != "profile"}
    # the workers import the code as it is when they start: a commit during the run is seen
    meta.update(seconds=time.monotonic() - t0, commit_start=commit,
                commit=_git("rev-parse", "HEAD"),
                dirty=_git("status", "--porcelain", "--", "backends").splitlines(),
                worker_defaults=worker_defaults(), mlx_lm=_version("mlx-lm"),
                mlx=_version("mlx"))
    write(results, [meta], args)
    return 0


def report(args: argparse.Namespace) -> int:
    """Tables and timelines again from saved interactive.json files (their models merged)."""
    results: dict[str, Any] = {}
    metas = []
    for path in args.report:
        saved = json.loads(Path(path).read_text())
        results.update(saved["results"])
        metas += saved["meta"] if isinstance(saved["meta"], list) else [saved["meta"]]
    write(results, metas, args)
    return 0


def write(results: dict[str, Any], metas: list[dict[str, Any]], args: argparse.Namespace
          ) -> None:
    summary = summarize(results)
    seconds = sum(m.get("seconds", 0) for m in metas)
    parts = [f"# bench/interactive.py ({seconds:.0f} s)", "",
             summary_table(summary), "", *verdicts(summary)]
    for model in results:
        for scenario in results[model]:
            parts += ["", f"## {model} ({scenario})", "", request_table(results, model, scenario)]
    text = "\n".join(parts) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "interactive.json").write_text(json.dumps(
        {"meta": metas, "summary": summary, "results": results}, indent=1))
    (args.out / "interactive.md").write_text(text)
    for model in results:
        png = args.out / f"interactive_{model}.png"
        plot(results, model, png)
        if args.img:
            shutil.copy(png, args.img / png.name)
    print(f"wrote {args.out / 'interactive.json'}, interactive.md, interactive_*.png")


def worker_defaults() -> dict[str, Any]:
    """The scheduler's settings the workers ran with, but those the configurations set."""
    from prefixd.backends.mlx.settings import WorkerSettings

    fields = WorkerSettings.model_fields
    return {k: fields[k].default for k in ("prefill_chunk", "prefill_slice", "prefill_slice_ms",
                                           "active_kv_share") if k in fields}


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    with contextlib.suppress(PackageNotFoundError):
        return version(dist)
    return ""


def _git(*cmd: str) -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    return ""


if __name__ == "__main__":
    sys.exit(main())
