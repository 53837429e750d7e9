"""A worker across machines (issue 28): the same conversation through a two-rank group, one
process, and stock `mlx_lm.server` running as the same group.

    ./run bench distributed                      # both models, 5 repeats: ~1-2 min here
    ./run bench distributed --models qwen3 --servers prefixd-one,prefixd-group --repeats 2

For each tiny model (tiny qwen3_next split pipeline-parallel, tiny qwen3 tensor-parallel: what
this mlx-lm offers for each) the same 6-turn append-only conversation (`workloads.chat`: each
turn appends the reply and ~200 new user tokens; greedy, streaming with usage) is played on
up to four servers, one after another (never two at once: 2 cores), all on loopback; each
server plays `--repeats` fresh conversations (another seed each: the TTFTs are medians):

  prefixd-one    the prefixd worker, one process (the reference)
  prefixd-group  the prefixd worker as a group of 2 ranks (`PREFIXD_GROUP_HOSTS`, the leader
                 starts its follower itself; `PREFIXD_PARALLEL` as above)
  stock-group    stock `mlx_lm.server` as a 2-rank ring group started here (`MLX_RANK`,
                 `MLX_HOSTFILE`; no mlx.launch, which spins a core), `--pipeline` for the
                 pipeline model (on a copy of the model folder with a safetensors index, which
                 mlx-lm's pipeline loading needs)
  stock-one      stock `mlx_lm.server`, one process

Per turn: prompt tokens, cached tokens (usage.prompt_tokens_details.cached_tokens), time to the
first content token, whether the reply (and prompt) equals prefixd-one's, and prefixd's own
stage times (usage.prefixd); the first conversation's last turn is sent again unstreamed with
logprobs, to compare the log-probabilities themselves. Per server and rank: RSS after
warm-up, peak RSS sampled every 50 ms (every rank's PID: the prefixd group's follower is its
leader's child, the stock ranks are ours), the kernel's VmHWM, CPU seconds during the
conversations and while idle. Then the restart check for both prefixd servers: SIGTERM (the
worker writes its disk tier), started again on the same PREFIXD_CACHE_DIR, the next turn: its
cached tokens and `usage.prefixd.cache.tier`. Every process started here is stopped by
PID. Writes bench/out/distributed.json and bench/out/distributed.md; results in
docs/BENCHMARKS.md.
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
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from multiturn import BLAS, OUT, ensure_model, free_port, get_json, healthy, stream_chat
from workloads import Reply, Scenario, chat

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"qwen3_next": "pipeline", "qwen3": "tensor"}
SERVERS = ("prefixd-one", "prefixd-group", "stock-group", "stock-one")
REF = "prefixd-one"
START_TIMEOUT_S = 180.0
SAMPLE_S = 0.05
IDLE_S = 2.0


@dataclass
class Server:
    """One server under test: the processes started here, its ranks (rank order) and what is
    measured about them."""

    name: str
    model: str
    port: int
    procs: list[subprocess.Popen[bytes]]   # what this script started (stopped by PID)
    expected: int                          # ranks
    ranks: list[psutil.Process] = field(default_factory=list)
    peak: list[int] = field(default_factory=list)
    hwm: list[int] = field(default_factory=list)
    exit_codes: list[int | str | None] = field(default_factory=list)
    stopped: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)

    def start_sampling(self) -> None:
        self.ranks = [psutil.Process(self.procs[0].pid)] if len(self.procs) == 1 else \
            [psutil.Process(p.pid) for p in self.procs]
        self.peak = [0] * self.expected
        threading.Thread(target=self._sample, daemon=True).start()

    def _discover(self) -> None:
        """The prefixd group's follower: a child of its leader (started by it)."""
        with contextlib.suppress(psutil.Error):
            kids = [c for c in self.ranks[0].children()
                    if "prefixd.backends.mlx" in " ".join(c.cmdline())]
            self.ranks += kids[: self.expected - len(self.ranks)]

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            if len(self.ranks) < self.expected:
                self._discover()
            for i, proc in enumerate(list(self.ranks)):
                with contextlib.suppress(psutil.Error):
                    self.peak[i] = max(self.peak[i], proc.memory_info().rss)

    def rss(self) -> list[int]:
        out = []
        for proc in self.ranks:
            try:
                out.append(int(proc.memory_info().rss))
            except psutil.Error:
                out.append(0)
        return out

    def cpu(self) -> list[float]:
        out = []
        for proc in self.ranks:
            try:
                t = proc.cpu_times()
                out.append(t.user + t.system)
            except psutil.Error:
                out.append(0.0)
        return out

    def read_hwm(self) -> None:
        self.hwm = []
        for proc in self.ranks:
            value = 0
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        value = int(line.split()[1]) * 1024
            self.hwm.append(value)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFIXD_", "MLX_"))}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    if Path(BLAS).exists():   # the same BLAS for every process (the worker would add it itself)
        env["LD_PRELOAD"] = BLAS
    return env | extra


def indexed_copy(model_dir: Path) -> Path:
    """A copy of a single-file model folder with `model.safetensors.index.json` (every tensor
    in model.safetensors, read from its header): mlx-lm's pipeline loading opens the index."""
    copy = Path(tempfile.mkdtemp(prefix="distributed-model-")) / model_dir.name
    shutil.copytree(model_dir, copy)
    weights = copy / "model.safetensors"
    with weights.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    index = {"metadata": {}, "weight_map": {k: weights.name for k in header
                                            if k != "__metadata__"}}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return copy


def start(name: str, arch: str, model_dir: Path, mode: str, log_dir: Path,
          cache_dir: str | None = None, stock_model: Path | None = None,
          prefixd_env: dict[str, str] | None = None) -> Server:
    port = free_port()
    prefixd_env = prefixd_env or {}
    log_dir.mkdir(parents=True, exist_ok=True)
    serve = ["--host", "127.0.0.1", "--port", str(port)]
    procs: list[subprocess.Popen[bytes]] = []
    if name.startswith("prefixd"):
        extra = {**prefixd_env, "PREFIXD_CACHE_DIR": str(cache_dir),
                 "PREFIXD_PARENT_PID": str(os.getpid())}
        if name == "prefixd-group":
            extra |= {"PREFIXD_GROUP_HOSTS": json.dumps(["127.0.0.1", "127.0.0.1"]),
                      "PREFIXD_PARALLEL": mode}
        with (log_dir / f"distributed-{arch}-{name}.log").open("ab") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "prefixd.backends.mlx", "--model", str(model_dir),
                 *serve], env=_env(extra), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        return _begin(Server(name, arch, port, procs, 2 if name == "prefixd-group" else 1))
    model = stock_model or model_dir
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model), *serve]
    if name == "stock-one":
        with (log_dir / f"distributed-{arch}-{name}.log").open("ab") as log:
            procs.append(subprocess.Popen(cmd, env=_env({}), cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT))
        return _begin(Server(name, arch, port, procs, 1))
    # stock-group: the ring's hostfile, then rank 0 (it accepts first) and rank 1 (it connects)
    fd, hostfile = tempfile.mkstemp(prefix="distributed-ring-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump([[f"127.0.0.1:{free_port()}"] for _ in range(2)], f)
    if mode == "pipeline":
        cmd.append("--pipeline")
    server = Server(name, arch, port, procs, 2)
    try:
        for rank in range(2):
            with (log_dir / f"distributed-{arch}-{name}-rank{rank}.log").open("ab") as log:
                procs.append(subprocess.Popen(
                    cmd, env=_env({"MLX_RANK": str(rank), "MLX_HOSTFILE": hostfile}), cwd=ROOT,
                    stdout=log, stderr=subprocess.STDOUT))
            time.sleep(0.3)
        _begin(server)
        wait_ready(server)     # the ring is up: its hostfile is no longer read
    except BaseException:
        stop(server)
        raise
    finally:
        os.unlink(hostfile)
    return server


def _begin(server: Server) -> Server:
    server.start_sampling()
    return server


def wait_ready(server: Server) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < START_TIMEOUT_S:
        if not server.alive():
            raise RuntimeError(f"{server.name} exited ({[p.poll() for p in server.procs]}); "
                               f"see bench/out/logs/distributed-{server.model}-{server.name}*")
        if healthy(server.port):
            return time.monotonic() - t0
        time.sleep(0.2)
    raise TimeoutError(f"{server.name} not ready after {START_TIMEOUT_S:.0f} s")


def stop(server: Server, grace: float = 30.0) -> float:
    """SIGTERM every process started here (by PID), SIGKILL after `grace`; then any rank still
    running (the prefixd group's follower must end with its leader: killed by PID if not, and
    reported). Seconds until the started processes exited."""
    if server.stopped:
        return 0.0
    server.stopped = True
    server.read_hwm()
    server._stop.set()
    t0 = time.monotonic()
    for proc in server.procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in server.procs:
        try:
            proc.wait(max(0.1, grace - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    took = time.monotonic() - t0
    server.exit_codes = [p.returncode for p in server.procs]
    for rank in server.ranks[len(server.procs):]:     # ranks started by a rank
        try:
            code = rank.wait(15)
            code = "exited" if code is None else code   # not our child: no status
        except psutil.TimeoutExpired:
            rank.kill()
            code = "KILLED: it outlived its leader"
        except psutil.NoSuchProcess:
            code = "exited"
        server.exit_codes.append(code)
    return took


class Player:
    """One server's copy of the conversation (the same user turns everywhere, its own replies)."""

    def __init__(self, arch: str, repeat: int, turns: int, args: argparse.Namespace) -> None:
        self.args = args
        self.steps: Scenario = chat(1.0, random.Random(f"distributed-{arch}-{repeat}"),
                                    turns=turns, per_turn=args.per_turn)
        self.reply: Reply | None = None
        self.last: dict[str, Any] = {}

    def turn(self, port: int, turn: int) -> dict[str, Any]:
        step = self.steps.send(self.reply) if self.reply is not None else next(self.steps)
        body = {**step.body, "max_tokens": self.args.max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        text, usage, ttft, total = stream_chat(port, body)
        self.reply, self.last = Reply(text), body
        pd = usage.get("prefixd") or {}
        return {"turn": turn, "prompt": usage["prompt_tokens"],
                "completion": usage.get("completion_tokens"),
                "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                "ttft": ttft, "total": total, "reply": text,
                "tier": (pd.get("cache") or {}).get("tier"),
                "passes": len(pd.get("prefill_segments") or []) or None, "prefixd": pd or None}

    def probe(self, port: int) -> list[float]:
        """The last request sent again, not streamed, with logprobs: each generated token's
        log-probability (both servers report them only unstreamed)."""
        body = {**self.last, "stream": False, "logprobs": True}
        body.pop("stream_options")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            answer = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        return [float(t["logprob"]) for t in answer["choices"][0]["logprobs"]["content"]]


def warm_up(port: int, max_tokens: int) -> None:
    """A short request and an unrelated longer one: the first passes of each shape are slower,
    and they should not be billed to turn 0 (as bench/restart.py)."""
    for content in ("warm up the server please", "warm " * 300):
        stream_chat(port, {"messages": [{"role": "user", "content": content}],
                           "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                           "stream_options": {"include_usage": True}})


def run_server(name: str, arch: str, mode: str, model_dir: Path, args: argparse.Namespace,
               stock_model: Path | None, rows: list[dict[str, Any]],
               info: dict[str, Any]) -> None:
    """The conversations on one server (and, for prefixd, the restart check): rows appended to
    `rows` as they are answered, what is measured about the server into `info`."""
    cache_dir = tempfile.mkdtemp(prefix="distributed-cache-") if name.startswith("prefixd") \
        else None
    mine = len(rows)
    log_dir = args.out / "logs"
    server: Server | None = None
    players = [Player(arch, rep, args.turns + 1, args) for rep in range(args.repeats)]
    try:
        t0 = time.monotonic()
        server = start(name, arch, model_dir, mode, log_dir, cache_dir, stock_model,
                       args.prefixd_env)
        wait_ready(server)
        info["ready_s"] = time.monotonic() - t0
        warm_up(server.port, args.max_tokens)
        info["pids"] = [p.pid for p in server.ranks]
        info["ready_rss"] = server.rss()
        c0 = server.cpu()
        time.sleep(IDLE_S)
        info["idle_cpu"] = [(b - a) / IDLE_S for a, b in zip(c0, server.cpu(), strict=False)]
        c0, t1 = server.cpu(), time.monotonic()
        for rep, player in enumerate(players):   # a fresh conversation each repeat
            for turn in range(args.turns):
                rows.append({"model": arch, "server": name, "phase": "conversation",
                             "repeat": rep, **player.turn(server.port, turn)})
        info["conversation_s"] = time.monotonic() - t1
        info["conversation_cpu"] = [b - a for a, b in zip(c0, server.cpu(), strict=False)]
        info["logprobs"] = players[0].probe(server.port)   # the first conversation's last turn
        if name.startswith("prefixd"):
            cache = get_json(server.port, "/v1/cache")
            group = cache.get("group") or {}
            info["worker_memory"] = [r.get("memory") for r in group.get("ranks", [])] or \
                [cache.get("memory")]
            info["parallel"] = group.get("parallel")
        info["stop_s"] = stop(server)
        info["peak_rss"], info["hwm"] = server.peak, server.hwm
        info["exit_codes"] = server.exit_codes
        for rep in range(args.repeats):
            got = [r for r in rows[mine:] if r["repeat"] == rep]
            print(f"  {arch:10} {name:13} repeat {rep} ttft ms "
                  f"{[round(r['ttft'] * 1000) for r in got]} cached "
                  f"{[r['cached'] for r in got]}", flush=True)
        if name.startswith("prefixd") and not args.no_restart:
            # the restart check: stopped (SIGTERM: its disk tier written), started again on
            # the same cache folder, the next turn
            t0 = time.monotonic()
            server = start(name, arch, model_dir, mode, log_dir, cache_dir,
                           prefixd_env=args.prefixd_env)
            restart: dict[str, Any] = {"ready_s": wait_ready(server)}
            rows.append({"model": arch, "server": name, "phase": "restart",
                         "repeat": args.repeats - 1,
                         **players[-1].turn(server.port, args.turns)})
            restart["stop_s"] = stop(server)
            restart["exit_codes"] = server.exit_codes
            info["restart"] = restart
            print(f"  {arch:10} {name:13} after restart: cached {rows[-1]['cached']} of "
                  f"{rows[-1]['prompt']}, tier {rows[-1]['tier']}", flush=True)
    finally:
        if server is not None:
            stop(server)
        if cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)


def compare(rows: list[dict[str, Any]]) -> None:
    """Mark each row against prefixd-one's row of the same model, phase and turn."""
    def key(r: dict[str, Any]) -> tuple[str, str, int, int]:
        return r["model"], r["phase"], r["repeat"], r["turn"]

    ref = {key(r): r for r in rows if r["server"] == REF}
    for r in rows:
        base = ref.get(key(r))
        r["same_reply"] = None if base is None else r["reply"] == base["reply"]
        r["same_prompt"] = None if base is None else r["prompt"] == base["prompt"]
        r["same_cached"] = None if base is None else r["cached"] == base["cached"]


def _mib(values: list[int] | None) -> str:
    return " / ".join(f"{v / 2**20:.0f}" for v in values or []) or "-"


def _yes(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "**no**")


def turn_table(rows: list[dict[str, Any]], servers: list[str]) -> str:
    """Per model and turn: the prompt and cached tokens of the first conversation, the median
    TTFT over the repeats, and on how many repeats the reply equals prefixd-one's."""
    names = " / ".join(servers)
    head = (f"| model | turn | prompt | cached: {names} | TTFT ms (median of repeats): {names} "
            f"| reply = {REF}'s: {' / '.join(servers[1:])} |\n|---|---:|---:|---|---|---|")
    lines = [head]
    conv = [r for r in rows if r["phase"] == "conversation"]
    for model in dict.fromkeys(r["model"] for r in conv):
        for t in sorted({r["turn"] for r in conv if r["model"] == model}):
            got = {s: [r for r in conv if r["model"] == model and r["turn"] == t
                       and r["server"] == s] for s in servers}
            first = {s: g[0] for s, g in got.items() if g}
            prompts = " or ".join(sorted({str(r["prompt"]) for r in first.values()}))
            cached = " / ".join(str(first[s]["cached"]) if s in first else "-" for s in servers)
            ttft = " / ".join(f"{statistics.median(r['ttft'] for r in got[s]) * 1000:.0f}"
                              if got[s] else "-" for s in servers)
            same = " / ".join(f"{sum(bool(r['same_reply']) for r in got[s])}/{len(got[s])}"
                              if got[s] else "-" for s in servers[1:])
            lines.append(f"| {model} | {t} | {prompts} | {cached} | {ttft} | {same} |")
    return "\n".join(lines)


def memory_table(infos: list[dict[str, Any]]) -> str:
    head = ("| model | server | ranks (mode) | ready s | RSS after warm-up MiB | peak RSS MiB "
            "(50 ms samples) | VmHWM MiB | MLX peak MiB (worker's /v1/cache) | CPU s in the "
            "conversation (wall s) | CPU while idle |\n|---|---|---|---:|---|---|---|---|---|---|")
    lines = [head]
    for i in infos:
        if "peak_rss" not in i:
            continue
        mlx = [m.get("mlx_peak_bytes", 0) for m in i.get("worker_memory") or [] if m]
        cpu = " / ".join(f"{c:.1f}" for c in i["conversation_cpu"])
        idle = " / ".join(f"{c:.0%}" for c in i["idle_cpu"])
        ranks = len(i["pids"])
        mode = f" ({i['mode']})" if ranks > 1 else ""
        lines.append(
            f"| {i['model']} | {i['server']} | {ranks}{mode} | {i['ready_s']:.1f} | "
            f"{_mib(i['ready_rss'])} | {_mib(i['peak_rss'])} | {_mib(i['hwm'])} | "
            f"{_mib(mlx)} | {cpu} ({i['conversation_s']:.1f}) | {idle} |")
    return "\n".join(lines)


def stage_table(rows: list[dict[str, Any]]) -> str:
    """prefixd's own breakdown (usage.prefixd), one process against the group: median ms over
    the repeats of restoring, prefilling and capturing checkpoints, and the prefill passes."""
    head = ("| model | turn | prefill passes: one / group | restore ms: one / group | prefill ms: "
            "one / group | checkpoint ms: one / group |\n|---|---:|---|---|---|---|")
    lines = [head]
    conv = [r for r in rows if r["phase"] == "conversation" and r.get("prefixd")]
    for model in dict.fromkeys(r["model"] for r in conv):
        for t in sorted({r["turn"] for r in conv if r["model"] == model}):
            got = {s: [r["prefixd"] for r in conv if r["model"] == model and r["turn"] == t
                       and r["server"] == s] for s in ("prefixd-one", "prefixd-group")}
            if not all(got.values()):
                continue

            def med(stage: str, got: dict[str, list[dict[str, Any]]] = got) -> str:
                return " / ".join(f"{statistics.median(p['timings_ms'][stage] for p in g):.1f}"
                                  for g in got.values())

            passes = " / ".join(f"{statistics.median(len(p['prefill_segments']) for p in g):.0f}"
                                for g in got.values())
            lines.append(f"| {model} | {t} | {passes} | {med('restore')} | {med('prefill')} | "
                         f"{med('checkpoint')} |")
    return "\n".join(lines)


def restart_table(rows: list[dict[str, Any]], infos: list[dict[str, Any]]) -> str:
    head = ("| model | server | SIGTERM to exit s (exit codes) | ready again in s | turn | "
            "prompt | previous prompt + reply | cached | tier | TTFT ms | reply = prefixd-one's |"
            "\n|---|---|---|---:|---:|---:|---:|---:|---|---:|---|")
    lines = [head]
    for i in infos:
        restart = i.get("restart")
        row = next((r for r in rows if r["model"] == i["model"] and r["server"] == i["server"]
                    and r["phase"] == "restart"), None)
        if not restart or row is None:
            continue
        before = next((r for r in rows if r["model"] == i["model"] and r["server"] == i["server"]
                       and r["repeat"] == row["repeat"] and r["turn"] == row["turn"] - 1), None)
        ideal = "-" if before is None else before["prompt"] + (before["completion"] or 0)
        lines.append(
            f"| {i['model']} | {i['server']} | {i['stop_s']:.1f} ({i['exit_codes']}) | "
            f"{restart['ready_s']:.1f} | {row['turn']} | {row['prompt']} | {ideal} | "
            f"{row['cached']} | "
            f"{row['tier']} | {row['ttft'] * 1000:.0f} | {_yes(row['same_reply'])} |")
    return "\n".join(lines)


def verdicts(rows: list[dict[str, Any]], infos: list[dict[str, Any]]) -> str:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        conv = [r for r in rows if r["model"] == model and r["phase"] == "conversation"]
        by = {s: [r for r in conv if r["server"] == s] for s in SERVERS}
        n = len(by[REF])
        for s in SERVERS[1:]:
            got = by[s]
            if not got or not n:
                continue
            same_reply = sum(bool(r["same_reply"]) for r in got)
            same_cached = sum(bool(r["same_cached"]) for r in got)
            out.append(f"- {model} {s}: replies equal to {REF}'s on {same_reply}/{n} turns; "
                       f"cached tokens equal on {same_cached}/{n}")
        if by["stock-one"] and by["stock-group"]:
            ones = {(r["repeat"], r["turn"]): r for r in by["stock-one"]}
            same = sum(r["reply"] == ones[k]["reply"] and r["cached"] == ones[k]["cached"]
                       for r in by["stock-group"] if (k := (r["repeat"], r["turn"])) in ones)
            out.append(f"- {model} stock-group against stock-one: replies and cached equal on "
                       f"{same}/{len(by['stock-group'])} turns")
        for group, one in (("prefixd-group", "prefixd-one"), ("stock-group", "stock-one")):
            if by[group] and by[one]:
                ones = {(r["repeat"], r["turn"]): r["ttft"] for r in by[one]}
                warm = [r["ttft"] / ones[(r["repeat"], r["turn"])] for r in by[group]
                        if r["turn"] > 0 and (r["repeat"], r["turn"]) in ones]
                if warm:
                    out.append(f"- {model} TTFT {group} / {one}, warm turns: median "
                               f"{statistics.median(warm):.2f}x (range {min(warm):.2f}-"
                               f"{max(warm):.2f})")
        for r in rows:
            if r["model"] == model and r["phase"] == "restart":
                out.append(f"- {model} {r['server']} restarted: turn {r['turn']} cached "
                           f"{r['cached']} of {r['prompt']} from tier {r['tier']!r}; reply equal "
                           f"to {REF}'s: {_yes(r['same_reply'])}")
    refs = {(i["model"], i["server"]): i.get("logprobs") for i in infos}
    for i in infos:
        mine = i.get("logprobs")
        for other in (REF, "stock-one") if i["server"] == "stock-group" else (REF,):
            ref = refs.get((i["model"], other))
            if i["server"] == other or not ref or not mine:
                continue
            if len(ref) == len(mine):
                diff = max(abs(a - b) for a, b in zip(ref, mine, strict=True))
                out.append(f"- {i['model']} {i['server']}: log-probabilities of the "
                           f"{len(mine)} generated tokens (first conversation's last turn, "
                           f"sent again unstreamed) differ from {other}'s by at most "
                           f"{diff:.1e}")
            else:
                out.append(f"- {i['model']} {i['server']}: {len(mine)} log-probabilities "
                           f"against {other}'s {len(ref)}")
    for i in infos:
        codes = [*i.get("exit_codes", []), *i.get("restart", {}).get("exit_codes", [])]
        if any(str(c).startswith("KILLED") for c in codes):
            out.append(f"- {i['model']} {i['server']}: a rank outlived its leader ({codes})")
        if "error" in i:
            out.append(f"- {i['model']} {i['server']} FAILED: {i['error']}")
    return "\n".join(out)


def _commit() -> str:
    """The checkout measured: its commit, "+dirty" when tracked files differ from it."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout
    return git("rev-parse", "--short", "HEAD").strip() + \
        ("+dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5, help="conversations per server (a fresh "
                   "one each, for the TTFT medians; the restart check continues the last)")
    p.add_argument("--per-turn", type=int, default=200, help="new user tokens per turn")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--no-restart", action="store_true", help="skip the restart check")
    p.add_argument("--prefixd-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for both prefixd servers, e.g. "
                   "PREFIXD_CHECKPOINT_INTERVAL=4096 (repeatable)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--models-dir", type=Path, default=OUT / "models")
    args = p.parse_args(argv)
    servers = [s for s in SERVERS if s in args.servers.split(",")]
    args.prefixd_env = dict(kv.split("=", 1) for kv in args.prefixd_env)
    # SIGTERM ends the run through its `finally`s (every process started here stopped by PID)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    load = [os.getloadavg()[0]]
    rows: list[dict[str, Any]] = []
    infos: list[dict[str, Any]] = []
    for arch in args.models.split(","):
        mode = MODELS[arch]
        model_dir = ensure_model(arch, args.models_dir)
        stock_model = indexed_copy(model_dir) if mode == "pipeline" and \
            "stock-group" in servers else None
        print(f"{arch} ({mode}-parallel groups):", flush=True)
        try:
            for name in servers:
                info: dict[str, Any] = {"model": arch, "server": name, "mode": mode}
                infos.append(info)
                try:
                    run_server(name, arch, mode, model_dir, args,
                               stock_model if name == "stock-group" else None, rows, info)
                except Exception as e:   # a server that fails is a result too
                    info["error"] = f"{type(e).__name__}: {e}"
                    print(f"  {arch:10} {name:13} FAILED: {info['error']}", flush=True)
        finally:
            if stock_model is not None:
                shutil.rmtree(stock_model.parent, ignore_errors=True)
        load.append(os.getloadavg()[0])
    compare(rows)
    text = "\n\n".join([turn_table(rows, servers), memory_table(infos), stage_table(rows),
                        restart_table(rows, infos), verdicts(rows, infos)])
    print(text)
    seconds = time.monotonic() - t0
    print(f"{seconds:.0f} s; 1-minute load average at the start and after each model {load}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    meta |= {"seconds": seconds, "loadavg": load, "cores": os.cpu_count(), "commit": _commit()}
    (args.out / "distributed.json").write_text(json.dumps(
        {"meta": meta, "servers": infos, "rows": rows}, indent=1))
    (args.out / "distributed.md").write_text(text + "\n")
    print(f"wrote {args.out / 'distributed.json'}, distributed.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
