"""Cache-affinity routing and llama-server slots (issue 17): policies side by side in one run.

    ./run bench routing                  # real llama-server where built, else the fake one
    ./run bench routing --real no        # fake upstreams only (seconds)
    ./run bench routing --convs 12 --turns 6 --setups b,c4,c12
    ./run bench routing --real yes --setups m4,m12,mb,od4,odb --policies prefixd
    ./run bench routing --real yes --setups m4 --convs 4 --turns 6 --restart-after 4

Conversations without session ids share one ~700-token system prompt and run at the same
time (each waits for its answer, thinks a little, sends its next turn), streaming, through
in-process prefixd replicas on loopback ports. Setups:

  a    3 prefixd workers (`prefixd worker` processes, backend kind "prefixd") on a tiny
       random-weight Qwen3-Next-style hybrid; with --real no, the fake llama-server
       (tests/fake_llama.py) with one slot and an unbounded RAM prompt cache instead
  b    3 llama-server processes, -np 1 (the real binary of bench/build_llama_server.sh, or
       the fake with the same flags when it is not built)
  c4   one llama-server, -np 4, 4 conversations (fewer or as many as slots)
  c12  the same server, 12 conversations (more than slots)
  d    two prefixd replicas in front of b's three servers; a conversation's turns alternate
       between the replicas, which share nothing
  m4   one llama-server that prefixd starts itself (backend kind "llama": 4 slots of 4096
       tokens, -t 2; every request pinned to the slot holding its prefix, slots saved into
       slot files and restored), 4 conversations; slot files in a fresh temporary cache_dir
       per run, removed after it
  m12  the same managed server, --convs conversations (more than slots)
  mb   three managed llama-servers of 1 slot each (-t 1), --convs conversations
  od4  one llama-server started with its default flags (-m, --host, --port, -t 2 only: no
       -np, -sps or -c) as kind "openai", 4 conversations
  odb  three such servers (-t 1 each) as kind "openai", --convs conversations

The managed setups (m4, m12, mb) run with policy prefixd only; `--kill-at K` SIGKILLs the
llama-server of b1 (b0 when there is one backend) by PID and prefixd restarts it itself;
`--restart-after T` runs every conversation for T turns, shuts prefixd down (which saves the
slots into slot files), starts a new prefixd on the same cache_dir and sends each
conversation's turn T once: cached / prompt tokens of that turn per conversation (target
>= 0.90). The prefixd log of a managed run, with the llama-server's own lines, is written to
bench/out/routing-SETUP[-restart|-kill].log.

Policies (a bench-only hook, `Router.policy`): prefixd (`proxy/routing/policy.py` `decide`),
round-robin, least-loaded, lane-only (`choose`). On c4/c12 (one backend) the rows compare
prefixd with and without slot pinning instead; the m and od setups run prefixd only. Per run:
recomputed prompt tokens (sum of prompt_tokens - cached_tokens the backends reported)
against the single-backend ideal (every token no earlier prompt + reply shares, computed
once): ratio (1.0 perfect) and reuse (cached as a share of the ideal's cached); median time to
first token; p99 queue wait (time to first token minus the server's own prompt time: waiting
in prefixd's queue, for a slot, or for compute). Writes bench/out/routing.json and
bench/out/routing.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import logging
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import multiturn  # noqa: E402  (bench/: the worker processes of setup a)
from fake_llama import FakeLlama, lcp, render, tokenize  # noqa: E402
from llama_process import LlamaServer, builtin_gguf, llama_server_binary  # noqa: E402

from prefixd.backends.llama.info import parse_props  # noqa: E402
from prefixd.backends.registry import build_backends  # noqa: E402
from prefixd.metrics.proxy import UPSTREAM_RESENDS  # noqa: E402
from prefixd.proxy.app import WARMUPS_KEY  # noqa: E402
from prefixd.proxy.routing.policy import Candidate, Decision  # noqa: E402
from prefixd.proxy.server import Server, make_proxy  # noqa: E402
from prefixd.proxy.settings import Settings  # noqa: E402


def choose(candidates: list[Candidate], affinity: str | None, slack: int = 2) -> Candidate:
    """The lane-only policy (a baseline for comparison): the lane's last backend
    while it is up and within `slack` requests per slot of the least loaded."""
    up = [c for c in candidates if c.up] or candidates
    best = min(up, key=lambda c: (c.load / c.max_concurrency, candidates.index(c)))
    if affinity is not None:
        for c in up:
            if c.name == affinity and (c.load - best.load) <= slack * c.max_concurrency:
                return c
    return best


OUT = ROOT / "bench" / "out"
WORDS = ["module", "parser", "request", "handler", "cache", "token", "queue", "backend",
         "index", "prefix", "test", "function", "class", "import", "return", "value", "error",
         "retry", "stream", "socket", "buffer", "worker"]


def system_prompt(words: int = 540) -> str:
    rng = random.Random(7)
    lines = ["You are a coding agent in a large repository. Follow these rules exactly."]
    n = len(lines[0].split())
    i = 0
    while n < words:
        i += 1
        line = f"Rule {i}: " + " ".join(rng.choice(WORDS) for _ in range(10)) + "."
        lines.append(line)
        n += len(line.split())
    return "\n".join(lines)


SYSTEM = system_prompt()


def user_turn(conv: int, turn: int, lines: int) -> str:
    """An agent's next turn: a tool result (`lines` lines of code) and the next instruction."""
    rng = random.Random(conv * 1000 + turn)
    code = "\n".join(f"    {rng.choice(WORDS)}_{i} = {rng.choice(WORDS)}({rng.randint(0, 99)})"
                     for i in range(lines))
    return (f"Conversation {conv}, step {turn}. Tool output of src/{rng.choice(WORDS)}_{conv}"
            f".py:\n{code}\nFix the {rng.choice(WORDS)} bug near line "
            f"{rng.randint(10, 900)}, then report what changed in one sentence.")


# --- policies --------------------------------------------------------------------------

def round_robin() -> Any:
    counter = itertools.count()

    def policy(cands: list[Candidate], affinity: str | None, key: str) -> Decision:
        c = cands[next(counter) % len(cands)]
        return Decision(c.name, "round_robin", c.shared)
    return policy


def least_loaded() -> Any:
    def policy(cands: list[Candidate], affinity: str | None, key: str) -> Decision:
        c = min(cands, key=lambda c: (c.load / c.max_concurrency, cands.index(c)))
        return Decision(c.name, "least_loaded", c.shared)
    return policy


def lane_only() -> Any:
    def policy(cands: list[Candidate], affinity: str | None, key: str) -> Decision:
        c = choose(cands, affinity)
        return Decision(c.name, "lane_only", c.shared)
    return policy


# "prefixd" keeps the router's own policy (`decide` with the PREFIXD_ROUTE_* thresholds)
POLICIES = {"prefixd": None, "round-robin": round_robin,
            "least-loaded": least_loaded, "lane-only": lane_only}


# --- upstreams ---------------------------------------------------------------------------

@dataclass
class Upstreams:
    kind: str                         # "llama-server" | "fake llama-server" | "prefixd-style"
    flags: str
    urls: list[str]
    slots: int
    fakes: list[FakeLlama] = field(default_factory=list)
    procs: list[LlamaServer] = field(default_factory=list)
    workers: list[Any] = field(default_factory=list)   # multiturn.Server: prefixd workers
    managed: list[dict] = field(default_factory=list)  # kind "llama" backends prefixd starts
    cache_dir: Path | None = None                       # theirs: slot files (removed at stop)

    @property
    def backend_kind(self) -> str:
        return "llama" if self.managed else "prefixd" if self.workers else "openai"

    @property
    def n(self) -> int:
        return len(self.managed) or len(self.urls)

    async def stop(self) -> None:
        for f in self.fakes:
            await f.stop()
        for p in self.procs:
            await p.stop()
        for w in self.workers:
            await asyncio.to_thread(multiturn.stop_server, w)
        if self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)


WORKER_ARCH = "qwen3_next"

# managed setups: backends, slots each, llama_args; default-flag setups: servers, threads each
MANAGED = {"m4": (1, 4, ["-t", "2"]), "m12": (1, 4, ["-t", "2"]), "mb": (3, 1, ["-t", "1"])}
DEFAULT_FLAGS = {"od4": (1, 2), "odb": (3, 1)}
FOUR_CONVS = {"c4", "m4", "od4"}


# the workers share one transfer secret (prefix states move only between workers that hold
# the same one: the "prefixd + transfers" rows), a new one per run
WORKER_OPTS = argparse.Namespace(out=OUT, prefixd_env={
    "PREFIXD_LOG_LEVEL": "WARNING", "PREFIXD_TRANSFER_SECRET": os.urandom(16).hex()},
    kv_bits=None)


async def start_workers(n: int) -> Upstreams:
    """`n` prefixd worker processes on the tiny hybrid (each with its own fresh disk tier)."""
    model_dir = multiturn.ensure_model(WORKER_ARCH, OUT / "models")
    opts = WORKER_OPTS
    workers = []
    try:
        for _ in range(n):
            workers.append(multiturn.start_server("prefixd", model_dir, opts))
        for w in workers:
            await asyncio.to_thread(multiturn.wait_ready, w)
            await asyncio.to_thread(multiturn.warm_up, w, 4)
    except BaseException:
        for w in workers:
            multiturn.stop_server(w)
        raise
    return Upstreams(f"prefixd worker ({WORKER_ARCH} tiny)", "defaults",
                     [f"http://127.0.0.1:{w.port}" for w in workers], 1, workers=workers)


def managed_upstreams(setup: str) -> Upstreams:
    """The kind "llama" backends of a managed setup (prefixd starts their servers), with a
    fresh cache_dir for their slot files."""
    n, slots, extra = MANAGED[setup]
    binary = llama_server_binary()
    assert binary is not None
    cache = Path(tempfile.mkdtemp(prefix=f"prefixd-routing-{setup}-"))
    configs = [{"name": f"b{i}", "kind": "llama", "model": str(builtin_gguf()), "models": ["m"],
                "slots": slots, "context_window": 4096, "llama_args": list(extra),
                "health_interval_s": 60} for i in range(n)]
    flags = (f"-np {slots} -c {slots * 4096} {' '.join(extra)} + prefixd's (--slot-save-path, "
             "-sps 0, --no-kv-unified, --cache-ram, --metrics)")
    return Upstreams("llama-server managed by prefixd", flags, [], slots, managed=configs,
                     cache_dir=cache)


async def start_default_servers(setup: str) -> Upstreams:
    """llama-servers with their default flags (-m, --host, --port, -t only), used as kind
    "openai"; their slot count is what /props reports."""
    n, threads = DEFAULT_FLAGS[setup]
    binary, model = llama_server_binary(), builtin_gguf()
    assert binary is not None
    OUT.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(n):
        p = LlamaServer(binary, model, threads=threads, log=OUT / f"llama-server-{setup}-{i}.log")
        p.args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(p.port),
                  "-t", str(threads)]
        procs.append(p)
    ups = Upstreams("llama-server, default flags", procs[0].flags, [p.url for p in procs], 1,
                    procs=procs)
    try:
        for p in procs:
            await p.start()
        async with aiohttp.ClientSession() as http, http.get(procs[0].url + "/props") as r:
            info = parse_props(await r.json())
    except BaseException:
        await ups.stop()
        raise
    if info is not None:
        ups.slots = info.total_slots
        ups.flags += f" (/props: {info.total_slots} slots, n_ctx {info.n_ctx})"
    return ups


async def start_upstreams(setup: str, real: bool, ms_per_token: float) -> Upstreams:
    if setup in MANAGED:
        return managed_upstreams(setup)
    if setup in DEFAULT_FLAGS:
        return await start_default_servers(setup)
    n, slots = (1, 4) if setup.startswith("c") else (3, 1)
    if setup == "a" and real:
        return await start_workers(n)
    if setup == "a":
        fakes = [FakeLlama(slots=1, similarity=0.0, ms_per_token=ms_per_token)
                 for _ in range(n)]
        for f in fakes:
            await f.start()
        return Upstreams("prefixd-style (fake, 1 slot + unbounded RAM cache)", "",
                         [f.url for f in fakes], 1, fakes=fakes)
    extra = ["-sps", "0"]
    if real:
        binary, model = llama_server_binary(), builtin_gguf()
        assert binary is not None
        OUT.mkdir(parents=True, exist_ok=True)
        procs = [LlamaServer(binary, model, slots=slots, ctx_per_slot=4096,
                             threads=2 if n == 1 else 1, extra=extra,
                             log=OUT / f"llama-server-{setup}-{i}.log") for i in range(n)]
        for p in procs:
            await p.start()
        return Upstreams("llama-server", procs[0].flags, [p.url for p in procs], slots,
                         procs=procs)
    fakes = [FakeLlama(slots=slots, similarity=0.0, ms_per_token=ms_per_token)
             for _ in range(n)]
    for f in fakes:
        await f.start()
    return Upstreams("fake llama-server", f"-np {slots} -sps 0 (modelled)",
                     [f.url for f in fakes], slots, fakes=fakes)


async def kill_and_restart(ups: Upstreams, at: float, events: list[str]) -> None:
    """`--kill-at`: kill backend b1 (SIGKILL, by PID) `at` seconds into the run, and start it
    again on the same port 2 s later, with an empty cache."""
    await asyncio.sleep(at)
    t0 = time.monotonic()
    if ups.workers:
        old = ups.workers[1]
        old.proc.kill()
        old.proc.wait(10)
        events.append(f"killed b1 (pid {old.proc.pid}) at {at:g}s")
        await asyncio.sleep(2.0)
        model_dir = multiturn.ensure_model(WORKER_ARCH, OUT / "models")
        new = multiturn.start_server("prefixd", model_dir, WORKER_OPTS, port=old.port)
        ups.workers[1] = new
        multiturn.stop_server(old)              # its disk tier goes; the process is gone
        await asyncio.to_thread(multiturn.wait_ready, new)
    elif ups.procs:
        proc = ups.procs[1]
        assert proc.proc is not None
        proc.proc.kill()
        events.append(f"killed b1 (pid {proc.proc.pid}) at {at:g}s")
        await proc.stop()
        await asyncio.sleep(2.0)
        await proc.start()
    else:
        events.append("--kill-at: no process to kill (fake upstreams)")
        return
    events.append(f"b1 back after {time.monotonic() - t0:.1f}s")


async def kill_managed(server: Server, at: float, events: list[str]) -> None:
    """`--kill-at` on a managed setup: SIGKILL the llama-server of b1 (b0 when it is the only
    backend) by PID `at` seconds into the run; prefixd restarts it itself."""
    await asyncio.sleep(at)
    backends = list(server.proxy.backends.values())
    b = backends[1] if len(backends) > 1 else backends[0]
    pid = b.status().detail.get("pid")
    if pid is None:
        events.append(f"--kill-at: {b.name} had no process at {at:g}s")
        return
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    events.append(f"killed {b.name} (pid {pid}) at {at:g}s")
    while time.monotonic() - t0 < 180.0:
        await asyncio.sleep(0.2)
        st = b.status()
        new = st.detail.get("pid")
        if st.state.value == "ready" and new not in (None, pid):
            events.append(f"{b.name} restarted by prefixd (pid {new}) after "
                          f"{time.monotonic() - t0:.1f}s")
            return
    st = b.status()
    events.append(f"{b.name} not back within 180s: {st.state.value} {st.last_error}")


# --- one run -------------------------------------------------------------------------------

@dataclass
class Req:
    conv: int
    turn: int
    replica: int
    backend: str
    start: float
    end: float
    ttft: float
    prompt: int
    cached: int
    prompt_ms: float
    body: dict
    reply: str
    predicted: int | None = None      # X-Prefixd-Prefix `predicted=` (None: no report)


class StreamFailed(Exception):
    pass


async def read_stream(r: aiohttp.ClientResponse, start: float, text: list[str], usage: dict,
                      timings: dict) -> None:
    """Read an SSE answer: content pieces, usage, llama-server's timings, and the time to
    the first content piece (as timings["_ttft"], from `start`)."""
    async for line in r.content:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if "error" in ev:                       # failed after a queued stream began
            raise StreamFailed(str(ev["error"])[:200])
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content")
            if piece:
                timings.setdefault("_ttft", time.monotonic() - start)
                text.append(piece)
        usage.update(ev.get("usage") or {})
        timings.update(ev.get("timings") or {})


async def converse(http: aiohttp.ClientSession, ports: list[int], conv: int,
                   args: argparse.Namespace, out: list[Req], errors: list[str],
                   turns: range | None = None, replies: list[str] | None = None) -> None:
    """`turns` of conversation `conv` (default: all of --turns); `replies`: the answers of
    its earlier turns (extended with the new ones)."""
    rng = random.Random(args.seed * 100 + conv)
    replies = [] if replies is None else replies
    turns = range(args.turns) if turns is None else turns
    max_tokens = args.max_tokens
    await asyncio.sleep(conv * args.stagger)          # sessions start one after another
    for t in turns:
        await asyncio.sleep(rng.uniform(0.0, 0.2))
        msgs: list[dict] = [{"role": "system", "content": SYSTEM}]
        for k in range(t + 1):
            msgs.append({"role": "user", "content": user_turn(conv, k, args.tool_lines)})
            if k < t:
                msgs.append({"role": "assistant", "content": replies[k]})
        body = {"model": "m", "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        replica = (conv + t) % len(ports)
        for _attempt in range(3):
            start = time.monotonic()
            text: list[str] = []
            usage: dict[str, Any] = {}
            timings: dict[str, Any] = {}
            async with http.post(f"http://127.0.0.1:{ports[replica]}/v1/chat/completions",
                                 json=body) as r:
                if r.status != 200:             # counted, and the turn is sent again
                    errors.append(f"{r.status}: {(await r.text())[:200]}")
                    continue
                backend = r.headers.get("X-Prefixd-Backend", "?")
                predicted = _predicted(r.headers.get("X-Prefixd-Prefix", ""))
                try:
                    await read_stream(r, start, text, usage, timings)
                except StreamFailed as e:
                    errors.append(f"stream: {e}")
                    continue
                ttft = timings.pop("_ttft", None)
                break
        else:
            raise RuntimeError(f"conversation {conv} turn {t} failed 3 times: {errors[-1]}")
        reply = "".join(text)
        replies.append(reply)
        details = usage.get("prompt_tokens_details") or {}
        # the server's own prompt time: llama-server's timings, a prefixd worker's breakdown
        prompt_ms = timings.get("prompt_ms") or (
            (usage.get("prefixd") or {}).get("timings_ms") or {}).get("prefill", 0.0)
        out.append(Req(conv, t, replica, backend, start, time.monotonic(),
                       ttft if ttft is not None else time.monotonic() - start,
                       usage.get("prompt_tokens", 0), details.get("cached_tokens", 0),
                       float(prompt_ms), body, reply, predicted))


async def gather_all(*coros: Any) -> list[Any]:
    """All of `coros` at once; the first failure cancels the others (a conversation that
    gave up ends the run) and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _predicted(header: str) -> int | None:
    """`predicted=N` of an X-Prefixd-Prefix header."""
    for part in header.replace(";", " ").split():
        if part.startswith("predicted="):
            with contextlib.suppress(ValueError):
                return int(part.split("=", 1)[1])
    return None


async def start_replicas(urls: list[str], slots: int, replicas: int, policy: str,
                         pins: bool, kind: str = "openai", transfers: bool = True,
                         managed: list[dict] | None = None, cache_dir: Path | None = None
                         ) -> list[Server]:
    """prefixd replicas in front of `urls`, or (`managed`) one that starts its own kind
    "llama" backends, their slot files under `cache_dir`, ready when this returns."""
    backends = managed or [{"name": f"b{i}", "kind": kind, "url": u, "models": ["m"],
                            "max_concurrency": slots, "health_interval_s": 60}
                           for i, u in enumerate(urls)]
    extra: dict[str, Any] = {} if transfers else {"route_transfer_min_tokens": 0}
    if managed:
        extra.update(llama_server=str(llama_server_binary()), cache_dir=cache_dir)
    servers = []
    for _ in range(replicas):
        settings = Settings(_env_file=None, backends=backends, log_level="WARNING", **extra)
        server = Server(make_proxy(settings, build_backends(settings.backends, settings)))
        await server.start("127.0.0.1", 0)
        servers.append(server)
        if managed:                       # their servers are up before the first request
            try:
                await asyncio.gather(*server.app[WARMUPS_KEY], return_exceptions=True)
                for b in server.proxy.backends.values():
                    await b.ensure_ready()
            except BaseException:
                for s in servers:
                    await s.shutdown(5.0)
                raise
        make_policy = POLICIES[policy]
        if make_policy is not None:
            server.proxy.router.policy = make_policy()
        for b in server.proxy.backends.values():
            if kind != "openai":
                continue
            await b.detect_slots()          # type: ignore[attr-defined]
            if not pins:                    # no slot planner: the server places every request
                b.slot_info = lambda: None  # type: ignore[method-assign]
    return servers


async def tokens_of(http: aiohttp.ClientSession, url: str | None, reqs: list[Req],
                    worker: bool = False, headers: dict[str, str] | None = None
                    ) -> list[tuple[list[Any], list[Any]]]:
    """(prompt tokens, reply tokens) per request: the server's tokenizer, or the fake's
    (`headers`: a managed llama-server's Authorization)."""
    out = []
    for r in reqs:
        if url is None:
            out.append((tokenize(render(r.body)), tokenize(r.reply)))
            continue
        if worker:                      # a prefixd worker's /tokenize
            got = []
            for q in ({"messages": r.body["messages"], "boundaries": False},
                      {"content": r.reply}):
                async with http.post(url + "/tokenize", json=q) as t:
                    got.append((await t.json())["tokens"])
            out.append((got[0], got[1]))
            continue
        async with http.post(url + "/apply-template", json={"messages": r.body["messages"]},
                             headers=headers) as a:
            prompt = (await a.json())["prompt"]
        toks = []
        for text in (prompt, r.reply):
            async with http.post(url + "/tokenize", json={"content": text,
                                                          "add_special": text is prompt},
                                 headers=headers) as t:
                toks.append((await t.json())["tokens"])
        out.append((toks[0], toks[1]))
    return out


def ideal_computed(reqs: list[Req], toks: list[tuple[list[Any], list[Any]]]) -> list[int]:
    """Per request, the tokens one backend with an unbounded cache computes, serving the
    requests one after another in the order they were sent: all but the longest prefix it
    shares with an earlier request's prompt + reply (`reqs` are in that order)."""
    out = []
    for i in range(len(reqs)):
        prompt = toks[i][0]
        best = max((lcp(toks[j][0] + toks[j][1], prompt) for j in range(i)), default=0)
        out.append(len(prompt) - min(best, len(prompt) - 1))
    return out


def resends(n: int) -> float:
    """Requests prefixd sent again on a new connection (the upstream had closed the pooled
    one under them), all replicas and backends of a run together (one metrics registry)."""
    return sum(UPSTREAM_RESENDS.labels(f"b{i}")._value.get() for i in range(n))


def ideal_source(ups: Upstreams, server: Server) -> tuple[str | None, dict[str, str]]:
    """Where the ideal's tokens come from: the first upstream, a managed setup's b0 (its URL
    and token from the running backend), or None (the fake's tokenizer)."""
    if ups.managed:
        b0 = server.proxy.backends["b0"]
        keeper = b0.slot_keeper()
        return b0.status().detail["url"], (dict(keeper.api.auth) if keeper else {})
    return (ups.urls[0] if ups.procs or ups.workers else None), {}


def keeper_counts(server: Server) -> collections.Counter[str]:
    """The slot keepers' counts (placements, saves, restores) of a prefixd's managed
    backends (their current processes)."""
    out: collections.Counter[str] = collections.Counter()
    for b in server.proxy.backends.values():
        keeper = getattr(b, "keeper", None)
        if keeper is not None:
            out.update(keeper.counts)
    return out


@contextlib.contextmanager
def run_log(path: Path | None) -> Any:
    """prefixd's log at INFO (a managed llama-server's own lines among it) into `path`;
    warnings still on stderr."""
    if path is None:
        yield
        return
    logger = logging.getLogger("prefixd")
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path, mode="w")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    to_err = logging.StreamHandler()
    to_err.setLevel(logging.WARNING)
    level = logger.level
    logger.addHandler(to_file)
    logger.addHandler(to_err)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(to_file)
        logger.removeHandler(to_err)
        logger.setLevel(level)
        to_file.close()


async def restart_turn(servers: list[Server], ups: Upstreams, http: aiohttp.ClientSession,
                       args: argparse.Namespace, convs: int, history: dict[int, list[str]],
                       toks: list[tuple[list[Any], list[Any]]]) -> dict[str, Any]:
    """`--restart-after T`: shut the prefixd down (it saves the slots into slot files), start a
    new one on the same cache_dir, send every conversation's turn T once. Per conversation:
    cached / prompt tokens of that turn, and cached / what the ideal would find cached (the
    longest start it shares with an earlier prompt + reply of the run, `toks`)."""
    t_after = args.restart_after
    old = servers.pop()
    t0 = time.monotonic()
    saved0 = keeper_counts(old)["save_saved"]
    await old.shutdown(30.0)
    saved = keeper_counts(old)["save_saved"] - saved0
    down = time.monotonic() - t0
    servers.extend(await start_replicas([], ups.slots, 1, "prefixd", True, ups.backend_kind,
                                        managed=ups.managed, cache_dir=ups.cache_dir))
    up = time.monotonic() - t0 - down
    after: list[Req] = []
    errors: list[str] = []
    await gather_all(*(converse(http, [servers[0].port], c, args, after, errors,
                                turns=range(t_after, t_after + 1), replies=history[c])
                       for c in range(convs)))
    after.sort(key=lambda r: r.conv)
    url, headers = ideal_source(ups, servers[0])
    toks_after = await tokens_of(http, url, after, headers=headers)
    ideal_cached = []
    for prompt, _ in toks_after:
        best = max((lcp(p + q, prompt) for p, q in toks), default=0)
        ideal_cached.append(min(best, len(prompt) - 1))
    shares = [r.cached / max(1, r.prompt) for r in after]
    return {"after": t_after, "cached": [r.cached for r in after],
            "prompt": [r.prompt for r in after], "ideal_cached": ideal_cached,
            "shares": shares, "min": min(shares) if shares else 0.0,
            "min_of_ideal": min((r.cached / max(1, i) for r, i in zip(after, ideal_cached,
                                                                       strict=True)),
                                default=0.0),
            "saved_at_shutdown": saved, "shutdown_s": down, "start_s": up, "errors": errors,
            "placements": dict(sorted(keeper_counts(servers[0]).items()))}


async def run_one(setup: str, policy: str, pins: bool, args: argparse.Namespace,
                  real: bool) -> dict[str, Any]:
    """One run; on setup a, `pins` means prefix state transfers between the workers."""
    ups = await start_upstreams(setup, real, args.ms_per_token)
    convs = 4 if setup in FOUR_CONVS else args.convs
    restart_after = args.restart_after if ups.managed else 0
    turns = restart_after or args.turns
    servers: list[Server] = []
    restart: dict[str, Any] | None = None
    suffix = "-restart" if restart_after else "-kill" if args.kill_at else ""
    with run_log(OUT / f"routing-{setup}{suffix}.log" if ups.managed else None):
        try:
            servers = await start_replicas(ups.urls, ups.slots, 2 if setup == "d" else 1,
                                           policy, pins, ups.backend_kind,
                                           transfers=pins and policy == "prefixd",
                                           managed=ups.managed, cache_dir=ups.cache_dir)
            reqs: list[Req] = []
            history: dict[int, list[str]] = {c: [] for c in range(convs)}
            timeout = aiohttp.ClientTimeout(total=600)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                ports = [s.port for s in servers]
                t0 = time.monotonic()
                errors: list[str] = []
                resent0 = resends(ups.n)
                events: list[str] = []
                chaos = []
                if args.kill_at:
                    chaos = [kill_managed(servers[0], args.kill_at, events) if ups.managed
                             else kill_and_restart(ups, args.kill_at, events)]
                await gather_all(*(converse(http, ports, c, args, reqs, errors,
                                            turns=range(turns), replies=history[c])
                                   for c in range(convs)), *chaos)
                wall = time.monotonic() - t0
                resent = resends(ups.n) - resent0
                reqs.sort(key=lambda r: r.start)
                url, headers = ideal_source(ups, servers[0])
                toks = await tokens_of(http, url, reqs, worker=bool(ups.workers), headers=headers)
                slot_pins: dict[str, int] = collections.Counter()
                copied = sum(s.proxy.router.truth[b]["transferred_tokens"] for s in servers
                             for b in s.proxy.backends)
                for s in servers:
                    for name in s.proxy.backends:
                        sl = s.proxy.router.planner(name)
                        if sl is not None:
                            slot_pins.update(sl.pins)
                    # a slot keeper's saves and restores beside its placements
                    slot_pins.update({k: v for k, v in keeper_counts(s).items()
                                      if k.startswith(("save_", "restore_"))})
                if restart_after:
                    restart = await restart_turn(servers, ups, http, args, convs, history,
                                                 toks)
        finally:
            for s in servers:
                await s.shutdown(5.0)
            await ups.stop()
    prompt = sum(r.prompt for r in reqs)
    recomputed = sum(r.prompt - r.cached for r in reqs)
    ideals = ideal_computed(reqs, toks)
    ideal = sum(ideals)
    later = [(r.prompt - r.cached, i) for r, i in zip(reqs, ideals, strict=True) if r.turn]
    waits = sorted(max(0.0, r.ttft - r.prompt_ms / 1000) for r in reqs)
    judged = [r for r in reqs if r.predicted is not None and r.turn]
    exact = sum(abs(r.predicted - r.cached) <= 16 for r in judged)  # type: ignore[operator]
    firsts = {f"b{i}": 0 for i in range(ups.n)}
    for r in reqs:
        if r.turn == 0:
            firsts[r.backend] = firsts.get(r.backend, 0) + 1
    return {
        "setup": setup, "upstream": ups.kind, "flags": ups.flags, "policy": policy,
        "pins": pins, "convs": convs, "requests": len(reqs), "prompt_tokens": prompt,
        "recomputed": recomputed, "ideal": ideal, "ratio": recomputed / max(1, ideal),
        "ratio_later": sum(a for a, _ in later) / max(1, sum(i for _, i in later)),
        "reuse": (prompt - recomputed) / max(1, prompt - ideal),
        "ttft_median_ms": 1000 * statistics.median(r.ttft for r in reqs),
        "queue_p99_ms": 1000 * waits[min(len(waits) - 1, int(0.99 * len(waits)))],
        "first_turns": firsts, "slot_pins": dict(slot_pins),
        "predicted_exact": f"{exact}/{len(judged)}",
        "predicted_error": sum(abs(r.predicted - r.cached) for r in judged)  # type: ignore[operator]
        / max(1, len(judged)),
        "wall_s": wall, "errors": errors, "resent": resent, "copied": copied,
        "events": events, "turns": turns, "restart": restart,
    }


def plan(setups: list[str]) -> list[tuple[str, str, bool]]:
    runs = []
    for s in setups:
        if s in ("c4", "c12") or s in DEFAULT_FLAGS:
            runs += [(s, "prefixd", True), (s, "prefixd", False)]
        elif s in MANAGED:
            runs += [(s, "prefixd", True)]
        elif s == "a":                  # prefixd with and without state transfers
            runs += [(s, p, True) for p in POLICIES] + [(s, "prefixd", False)]
        else:
            runs += [(s, p, True) for p in POLICIES]
    return runs


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| setup | upstream | policy | convs | reqs | recomputed | ideal | ratio "
           "| ratio, turns 2+ | reuse | TTFT p50 ms | queue p99 ms | first turns | slot pins "
           "| predicted ~ cached | copied in |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        policy = r["policy"]
        if r["setup"] in ("c4", "c12") or r["setup"] in DEFAULT_FLAGS:
            policy = "prefixd + slot pins" if r["pins"] else "prefixd, no pins"
        elif r["setup"] in MANAGED:
            policy = "prefixd + slot keeper"
        elif r["setup"] == "a" and policy == "prefixd":
            policy = "prefixd + transfers" if r["pins"] else "prefixd, no transfers"
        firsts = "/".join(str(v) for v in r["first_turns"].values())
        pins = ", ".join(f"{k} {v}" for k, v in sorted(r["slot_pins"].items())) or "-"
        out.append(f"| {r['setup']} | {r['upstream']} | {policy} | {r['convs']} | "
                   f"{r['requests']} | {r['recomputed']} | {r['ideal']} | {r['ratio']:.2f} | "
                   f"{r['ratio_later']:.2f} | "
                   f"{100 * r['reuse']:.1f}% | {r['ttft_median_ms']:.0f} | "
                   f"{r['queue_p99_ms']:.0f} | {firsts} | {pins} | "
                   f"{r.get('predicted_exact', '-')} | {r.get('copied', 0)} |")
    restarts = [r for r in rows if r.get("restart")]
    if restarts:
        out += ["", "| setup | convs | turns before the restart | saved at shutdown "
                "| turn T cached / prompt per conversation | min | ideal cached "
                "| min cached / ideal | placements after | failed |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in restarts:
            x = r["restart"]
            shares = ", ".join(f"{c}/{p} ({c / max(1, p):.2f})"
                               for c, p in zip(x["cached"], x["prompt"], strict=True))
            placed = ", ".join(f"{k} {v}" for k, v in x["placements"].items()) or "-"
            ideal = ", ".join(str(i) for i in x["ideal_cached"])
            out.append(f"| {r['setup']} | {r['convs']} | {x['after']} | "
                       f"{x['saved_at_shutdown']} | {shares} | {x['min']:.2f} | {ideal} | "
                       f"{x['min_of_ideal']:.2f} | {placed} | {len(x['errors'])} |")
    return "\n".join(out)


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setups", default="a,b,c4,c12,d")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--convs", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tool-lines", type=int, default=12,
                    help="lines of tool output in each user turn (~12 tokens each)")
    ap.add_argument("--stagger", type=float, default=0.3,
                    help="seconds between the starts of two conversations")
    ap.add_argument("--real", choices=("auto", "yes", "no"), default="auto",
                    help="use the built llama-server (auto: where bench/build_llama_server.sh "
                         "built it)")
    ap.add_argument("--ms-per-token", type=float, default=0.5,
                    help="fake upstreams: prompt processing time per computed token")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kill-at", type=float, default=0.0,
                    help="kill backend b1 this many seconds into each run and restart it on "
                         "the same port 2 s later (real processes only; 0: never; managed "
                         "setups: prefixd restarts it itself)")
    ap.add_argument("--restart-after", type=int, default=0,
                    help="managed setups: run T turns, restart prefixd (slots saved into slot "
                         "files), send each conversation's turn T once (0: never)")
    args = ap.parse_args()
    real = args.real == "yes" or (args.real == "auto" and llama_server_binary() is not None)
    own = set(args.setups.split(",")) & (set(MANAGED) | set(DEFAULT_FLAGS))
    if own and (not real or llama_server_binary() is None):
        print(f"setups {','.join(sorted(own))} need the real llama-server "
              "(bench/build_llama_server.sh, --real yes)", file=sys.stderr)
        return 2
    llama_setups = set(args.setups.split(",")) - {"a"}
    if real and llama_setups and llama_server_binary() is None:
        print("no llama-server built: run bench/build_llama_server.sh", file=sys.stderr)
        return 2
    wanted = set(args.policies.split(","))
    runs = [r for r in plan(args.setups.split(",")) if r[1] in wanted]
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for setup, policy, pins in runs:
        try:
            row = await run_one(setup, policy, pins, args, real)
        except Exception as e:              # reported; the other runs go on
            failed.append({"setup": setup, "policy": policy, "pins": pins,
                           "error": f"{type(e).__name__}: {e}"[:600]})
            print(f"{setup:4} {policy:13} pins={pins!s:5} FAILED: {failed[-1]['error']}",
                  flush=True)
            continue
        rows.append(row)
        print(f"{setup:4} {policy:13} pins={pins!s:5} ratio={row['ratio']:.2f} "
              f"later={row['ratio_later']:.2f} "
              f"reuse={100 * row['reuse']:.1f}% ttft50={row['ttft_median_ms']:.0f}ms "
              f"q99={row['queue_p99_ms']:.0f}ms firsts={row['first_turns']} "
              f"failed={len(row['errors'])}/{row['requests'] + len(row['errors'])} "
              f"resent={row['resent']:.0f} predicted~cached={row['predicted_exact']} "
              f"(mean error {row['predicted_error']:.0f} tok) copied={row['copied']} "
              f"({row['wall_s']:.1f}s)" + (f" {'; '.join(row['events'])}"
                                            if row["events"] else ""), flush=True)
        if row["restart"]:
            x = row["restart"]
            print(f"     restart after turn {x['after']}: saved {x['saved_at_shutdown']} "
                  f"slot(s) at shutdown ({x['shutdown_s']:.1f}s), new prefixd ready in "
                  f"{x['start_s']:.1f}s; turn {x['after']} cached/prompt "
                  + ", ".join(f"{c}/{p}" for c, p in zip(x["cached"], x["prompt"], strict=True))
                  + f"; min {x['min']:.2f} (target >= 0.90); ideal cached {x['ideal_cached']}"
                  f", min cached/ideal {x['min_of_ideal']:.2f}; failed {len(x['errors'])}; "
                  f"placements {x['placements']}", flush=True)
            for e in x["errors"]:
                print(f"     restart error: {e}", flush=True)
        for e in row["errors"]:
            print(f"     error: {e}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    cmd = "./run bench routing " + " ".join(sys.argv[1:])
    (OUT / "routing.json").write_text(json.dumps({"command": cmd, "args": vars(args),
                                                  "rows": rows, "failed": failed}, indent=1))
    md = f"`{cmd.strip()}`\n\n{table(rows)}\n" + "".join(
        f"\nFAILED: {f['setup']} {f['policy']} (pins={f['pins']}): {f['error']}\n"
        for f in failed)
    (OUT / "routing.md").write_text(md)
    print("\n" + md)
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(asyncio.run(main()))
