"""Multi-turn prompt-cache reuse: prefixd's mlx worker side by side with stock `mlx_lm.server`.

    ./run bench multiturn                      # full run, ~1.5 min on 2 shared CPU cores
    ./run bench multiturn --quick              # smoke run (--scale 0.25), ~1 min
    ./run bench multiturn --models qwen3_5 --scenarios ace --scale 0.5

For each tiny model (written once under bench/out/models/), one stock server and one prefixd
worker run at the same time on the same folder. Every scenario of `workloads.py` is sent to
both, one request at a time, streaming. Per request we record the server's prompt_tokens and
`usage.prompt_tokens_details.cached_tokens` (both servers report it: stock mlx-lm 0.32 sets it
to `len(prompt) - len(rest)` from its `LRUPromptCache.fetch_nearest_cache`), time to the first
content token, and the *ideal*: the longest common prefix of this prompt (tokenized here with
the model's chat template) with any earlier prompt + reply this server saw. Peak RSS is each
server's VmHWM (or sampled RSS where /proc is missing). Writes bench/out/multiturn.json,
bench/out/multiturn.md (tables) and bench/out/multiturn_ttft.png; results and their reading
are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from mlx_lm.tokenizer_utils import load as load_tokenizer
from multiturn_report import summarize, write_outputs
from workloads import SCENARIOS, Reply, ScenarioSpec, Step

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
MODELS = ("qwen3_next", "qwen3_5", "gemma3_text")
BLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
# The tiny configs say 4096; the prefixd worker enforces max_position_embeddings and scenario
# (g) needs >6,000 tokens. RoPE has no real limit, so the bench copies allow 16K.
CONTEXT = 16384
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Server:
    """One server process under test and what we learn about it."""

    kind: str  # "stock" | "prefixd"
    model: str
    port: int
    proc: subprocess.Popen[bytes]
    peak_rss: int = 0
    ready_rss: int = 0  # after loading and one warm-up request: the runtime, not the cache
    cache_info: dict[str, Any] = field(default_factory=dict)
    history: list[list[int]] = field(default_factory=list)
    cache_dir: str | None = None  # prefixd's own, removed when it stops
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample_rss(self) -> None:
        """Background sampler: the fallback where /proc/PID/status has no VmHWM."""
        proc = psutil.Process(self.proc.pid)
        while not self._stop.wait(0.25):
            with contextlib.suppress(psutil.Error):
                self.peak_rss = max(self.peak_rss, proc.memory_info().rss)

    def read_hwm(self) -> None:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_rss = max(self.peak_rss, int(line.split()[1]) * 1024)

    def read_rss(self) -> int:
        with contextlib.suppress(psutil.Error):
            return int(psutil.Process(self.proc.pid).memory_info().rss)
        return 0


@dataclass
class Record:
    model: str
    server: str
    scenario: str
    label: str
    prompt: int
    cached: int
    recomputed: int
    ideal: int
    ttft: float
    total: float
    tokenized: int  # our own count of the prompt; differs from `prompt` only on a template bug


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_model(arch: str, models_dir: Path) -> Path:
    from prefixd.backends.mlx.model.tiny import save_tiny_model

    path = models_dir / arch
    if not (path / "model.safetensors").exists():
        save_tiny_model(arch, path)
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    inner = config.get("text_config", config)
    if inner.get("max_position_embeddings") != CONTEXT:
        inner["max_position_embeddings"] = CONTEXT
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def start_server(kind: str, model_dir: Path, args: argparse.Namespace,
                 port: int | None = None, extra: tuple[str, ...] = (),
                 label: str | None = None) -> Server:
    """`kind`'s server on `model_dir` (`extra`: more command-line arguments; `label`: its
    log's name, default `kind`)."""
    port = port or free_port()
    module = "mlx_lm.server" if kind == "stock" else "prefixd.backends.mlx"
    cmd = [sys.executable, "-m", module, "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           # a prefixd worker exits when the bench is gone, even if it was killed
           "PREFIXD_PARENT_PID": str(os.getpid())}
    if Path(BLAS).exists():  # the same BLAS for both servers (the worker would add it itself)
        env["LD_PRELOAD"] = BLAS
    cache_dir = None
    if kind == "prefixd":
        # a fresh disk tier: states a previous bench run wrote must not serve this one
        cache_dir = tempfile.mkdtemp(prefix="prefixd-bench-cache-")
        env["PREFIXD_CACHE_DIR"] = cache_dir
        env.update(args.prefixd_env)
    if args.kv_bits:
        cmd += ["--kv-bits", str(args.kv_bits)] if kind == "stock" else []
        env["PREFIXD_KV_BITS"] = str(args.kv_bits)
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / f"{model_dir.name}-{label or kind}.log").open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    server = Server(kind, model_dir.name, port, proc, cache_dir=cache_dir)
    threading.Thread(target=server.sample_rss, daemon=True).start()
    return server


def wait_ready(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.kind} server exited with {server.proc.returncode}; "
                               f"see bench/out/logs/{server.model}-{server.kind}.log")
        if healthy(server.port):
            return
        time.sleep(0.2)  # no readiness event to wait on across a process boundary
    raise TimeoutError(f"{server.kind} server not ready after {START_TIMEOUT_S:.0f} s")


def healthy(port: int) -> bool:
    """Whether the server on this loopback port answers GET /health with 200 (now)."""
    with contextlib.suppress(OSError, http.client.HTTPException):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    return False


def end_process(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM a process started here (by PID), SIGKILL it after `grace` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def stop_server(server: Server) -> None:
    server.read_hwm()
    server._stop.set()
    end_process(server.proc, 10)
    if server.cache_dir:
        shutil.rmtree(server.cache_dir, ignore_errors=True)


def stream_chat(port: int, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S,
                first: Callable[[], None] | None = None
                ) -> tuple[str, dict[str, Any], float, float]:
    """POST a streaming chat request; (reply text, usage (with a prefixd worker's `prefixd`
    breakdown), time to first token, total time). `first` is called at its first token."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    text, usage, ttft = [], {}, None
    while line := resp.readline():
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue  # blank separators and stock's ": keepalive" comments
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"stream error: {event['error']}")
        usage = event.get("usage") or usage
        if isinstance(event.get("prefixd"), dict):  # a prefixd worker's per-turn breakdown
            usage = {**usage, "prefixd": event["prefixd"]}
        for choice in event.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                    if first is not None:
                        first()
                text.append(delta.get("content") or "")
    total = time.perf_counter() - t0
    conn.close()
    if not usage:  # stock mlx-lm drops the connection when generation raises
        raise RuntimeError("the stream ended without usage (the server failed; see its log)")
    return "".join(text), usage, total if ttft is None else ttft, total


def get_json(port: int, path: str) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        return dict(json.loads(conn.getresponse().read()))
    except (OSError, http.client.HTTPException, ValueError) as e:
        return {"error": str(e)}
    finally:
        conn.close()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prompt_tokens(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    messages = [{**m, "content": m.get("content") or ""} for m in body["messages"]]
    return list(tokenizer.apply_chat_template(messages, tools=body.get("tools"),
                                              add_generation_prompt=True))


def run_scenario(server: Server, spec: ScenarioSpec, tokenizer: Any, scale: float,
                 max_tokens: int, records: list[Record]) -> None:
    """Send the scenario's requests in order, appending one Record per answered request."""
    steps = spec.make(scale, random.Random(f"{spec.key}-{server.model}"))
    reply: Reply | None = None
    while True:
        try:
            step: Step = steps.send(reply) if reply is not None else next(steps)
        except StopIteration:
            return
        body = {**step.body, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        mine = prompt_tokens(tokenizer, body)
        ideal = max((common_prefix(mine, seen) for seen in server.history), default=0)
        text, usage, ttft, total = stream_chat(server.port, body)
        n = int(usage.get("prompt_tokens", len(mine)))
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        server.history.append(mine + tokenizer.encode(text, add_special_tokens=False))
        records.append(Record(server.model, server.kind, spec.key, step.label, n, cached,
                              n - cached, min(ideal, n), ttft, total, len(mine)))
        reply = Reply(text)


def warm_up(server: Server, max_tokens: int) -> None:
    """One short request first, so lazy MLX compilation is not billed to scenario (a)."""
    body = {"messages": [{"role": "user", "content": "warm up the server please"}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    stream_chat(server.port, body)


def run_side_by_side(servers: list[Server], spec: ScenarioSpec, tokenizer: Any,
                     args: argparse.Namespace) -> tuple[list[Record], list[dict[str, str]]]:
    """One scenario on every server in turn; a failed request ends that server's scenario."""
    records: list[Record] = []
    failures: list[dict[str, str]] = []
    for server in servers:
        t0, got, status = time.monotonic(), [], ""
        try:
            run_scenario(server, spec, tokenizer, args.scale, args.max_tokens, got)
        except Exception as e:  # a server that fails a request is a result too
            failures.append({"model": server.model, "server": server.kind,
                             "scenario": spec.key, "request": str(len(got)), "error": str(e)})
            status = f"  FAILED at request {len(got)}: {e}"
        records += got
        print(f"  {server.model:12} {server.kind:8} ({spec.key}) {len(got):3} requests "
              f"{time.monotonic() - t0:6.1f} s{status}", flush=True)
    return records, failures


def bench_model(arch: str, args: argparse.Namespace) -> tuple[list[Record], dict[str, Any]]:
    model_dir = ensure_model(arch, args.models_dir)
    tokenizer = load_tokenizer(model_dir)
    servers: list[Server] = []
    records: list[Record] = []
    failures: list[dict[str, str]] = []
    try:
        servers = [start_server(kind, model_dir, args) for kind in args.servers]
        for server in servers:
            wait_ready(server)
            warm_up(server, args.max_tokens)
            server.ready_rss = server.read_rss()
        for spec in SCENARIOS:
            if spec.key in args.scenarios and (not spec.models or arch in spec.models):
                got, failed = run_side_by_side(servers, spec, tokenizer, args)
                records, failures = records + got, failures + failed
        for server in servers:
            if server.kind == "prefixd":
                info = get_json(server.port, "/v1/cache")
                info["entries"] = len(info.get("entries", []))  # the count, not the listing
                server.cache_info = info
    finally:
        for server in servers:
            stop_server(server)
    info: dict[str, Any] = {s.kind: {"peak_rss": s.peak_rss, "ready_rss": s.ready_rss,
                                     "cache": s.cache_info} for s in servers}
    return records, info | {"failures": failures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS),
                   help="comma-separated tiny architectures")
    p.add_argument("--scenarios", default="abcdefgh", help="scenario letters to run")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every message length")
    p.add_argument("--quick", action="store_true", help="smoke run: --scale 0.25")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--servers", default="stock,prefixd")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--models-dir", type=Path, default=OUT / "models")
    p.add_argument("--kv-bits", type=int, choices=(4, 8),
                   help="quantize the KV cache on both servers (stock: --kv-bits)")
    p.add_argument("--prefixd-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the prefixd worker, e.g. "
                   "PREFIXD_CHECKPOINT_INTERVAL=256 (repeatable)")
    args = p.parse_args(argv)
    if args.quick:
        args.scale = min(args.scale, 0.25)
    args.servers = args.servers.split(",")
    args.prefixd_env = dict(kv.split("=", 1) for kv in args.prefixd_env)
    t0 = time.monotonic()
    records: list[Record] = []
    peaks: dict[str, dict[str, Any]] = {}
    for arch in args.models.split(","):
        print(f"{arch}:", flush=True)
        got, peaks[arch] = bench_model(arch, args)
        records += got
    rows = [asdict(r) for r in records]
    summary = summarize(rows, peaks)
    write_outputs(args.out, rows, peaks, summary, vars(args) | {"seconds": time.monotonic() - t0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
