"""Cache-affinity routing and llama-server slots (issue 17): policies side by side in one run.

    ./run bench routing                  # real llama-server where built, else the fake one
    ./run bench routing --real no        # fake upstreams only (seconds)
    ./run bench routing --convs 12 --turns 6 --setups b,c4,c12

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

Policies (a bench-only hook, `Router.policy`): prefixd (`proxy/routing/policy.py` `decide`),
round-robin, least-loaded, lane-only (`choose`). On c4/c12 (one backend) the rows compare
prefixd with and without slot pinning instead. Per run: recomputed prompt tokens (sum of
prompt_tokens - cached_tokens the backends reported) against the single-backend ideal (every
token no earlier prompt + reply shares, computed once): ratio (1.0 perfect) and reuse (cached
as a share of the ideal's cached); median time to first token; p99 queue wait (time to first
token minus the server's own prompt time: waiting in prefixd's queue, for a slot, or for
compute). Writes bench/out/routing.json and bench/out/routing.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import os
import random
import statistics
import sys
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

from prefixd.backends.registry import build_backends  # noqa: E402
from prefixd.metrics.proxy import UPSTREAM_RESENDS  # noqa: E402
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

    @property
    def backend_kind(self) -> str:
        return "prefixd" if self.workers else "openai"

    async def stop(self) -> None:
        for f in self.fakes:
            await f.stop()
        for p in self.procs:
            await p.stop()
        for w in self.workers:
            await asyncio.to_thread(multiturn.stop_server, w)


WORKER_ARCH = "qwen3_next"


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


async def start_upstreams(setup: str, real: bool, ms_per_token: float) -> Upstreams:
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
                   args: argparse.Namespace, out: list[Req], errors: list[str]) -> None:
    rng = random.Random(args.seed * 100 + conv)
    replies: list[str] = []
    turns, max_tokens = args.turns, args.max_tokens
    await asyncio.sleep(conv * args.stagger)          # sessions start one after another
    for t in range(turns):
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


def _predicted(header: str) -> int | None:
    """`predicted=N` of an X-Prefixd-Prefix header."""
    for part in header.replace(";", " ").split():
        if part.startswith("predicted="):
            with contextlib.suppress(ValueError):
                return int(part.split("=", 1)[1])
    return None


async def start_replicas(urls: list[str], slots: int, replicas: int, policy: str,
                         pins: bool, kind: str = "openai", transfers: bool = True
                         ) -> list[Server]:
    backends = [{"name": f"b{i}", "kind": kind, "url": u, "models": ["m"],
                 "max_concurrency": slots, "health_interval_s": 60} for i, u in enumerate(urls)]
    servers = []
    for _ in range(replicas):
        settings = Settings(_env_file=None, backends=backends, log_level="WARNING",
                            **({} if transfers else {"route_transfer_min_tokens": 0}))
        server = Server(make_proxy(settings, build_backends(settings.backends, settings)))
        await server.start("127.0.0.1", 0)
        make_policy = POLICIES[policy]
        if make_policy is not None:
            server.proxy.router.policy = make_policy()
        for b in server.proxy.backends.values():
            if kind != "openai":
                continue
            await b.detect_slots()          # type: ignore[attr-defined]
            if not pins:                    # no slot planner: the server places every request
                b.slot_info = lambda: None  # type: ignore[method-assign]
        servers.append(server)
    return servers


async def tokens_of(http: aiohttp.ClientSession, url: str | None, reqs: list[Req],
                    worker: bool = False) -> list[tuple[list[Any], list[Any]]]:
    """(prompt tokens, reply tokens) per request: the server's tokenizer, or the fake's."""
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
        async with http.post(url + "/apply-template", json={"messages": r.body["messages"]}) as a:
            prompt = (await a.json())["prompt"]
        toks = []
        for text in (prompt, r.reply):
            async with http.post(url + "/tokenize", json={"content": text,
                                                          "add_special": text is prompt}) as t:
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


def resends(urls: list[str]) -> float:
    """Requests prefixd sent again on a new connection (the upstream had closed the pooled
    one under them), all replicas and backends of a run together (one metrics registry)."""
    return sum(UPSTREAM_RESENDS.labels(f"b{i}")._value.get() for i in range(len(urls)))


async def run_one(setup: str, policy: str, pins: bool, args: argparse.Namespace,
                  real: bool) -> dict[str, Any]:
    """One run; on setup a, `pins` means prefix state transfers between the workers."""
    ups = await start_upstreams(setup, real, args.ms_per_token)
    convs = 4 if setup == "c4" else args.convs
    servers: list[Server] = []
    try:
        servers = await start_replicas(ups.urls, ups.slots, 2 if setup == "d" else 1,
                                       policy, pins, ups.backend_kind,
                                       transfers=pins and policy == "prefixd")
        reqs: list[Req] = []
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            ports = [s.port for s in servers]
            t0 = time.monotonic()
            errors: list[str] = []
            resent0 = resends(ups.urls)
            events: list[str] = []
            chaos = [kill_and_restart(ups, args.kill_at, events)] if args.kill_at else []
            await asyncio.gather(*(converse(http, ports, c, args, reqs, errors)
                                   for c in range(convs)), *chaos)
            wall = time.monotonic() - t0
            resent = resends(ups.urls) - resent0
            reqs.sort(key=lambda r: r.start)
            toks = await tokens_of(http, ups.urls[0] if ups.procs or ups.workers else None,
                                   reqs, worker=bool(ups.workers))
        slot_pins: dict[str, int] = collections.Counter()
        copied = sum(s.proxy.router.truth[b]["transferred_tokens"] for s in servers
                     for b in s.proxy.backends)
        for s in servers:
            for name in s.proxy.backends:
                sl = s.proxy.router.planner(name)
                if sl is not None:
                    slot_pins.update(sl.pins)
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
    firsts = {f"b{i}": 0 for i in range(len(ups.urls))}
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
        "events": events,
    }


def plan(setups: list[str]) -> list[tuple[str, str, bool]]:
    runs = []
    for s in setups:
        if s in ("c4", "c12"):
            runs += [(s, "prefixd", True), (s, "prefixd", False)]
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
        if r["setup"] in ("c4", "c12"):
            policy = "prefixd + slot pins" if r["pins"] else "prefixd, no pins"
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
                         "the same port 2 s later (real processes only; 0: never)")
    args = ap.parse_args()
    real = args.real == "yes" or (args.real == "auto" and llama_server_binary() is not None)
    llama_setups = set(args.setups.split(",")) - {"a"}
    if real and llama_setups and llama_server_binary() is None:
        print("no llama-server built: run bench/build_llama_server.sh", file=sys.stderr)
        return 2
    wanted = set(args.policies.split(","))
    runs = [r for r in plan(args.setups.split(",")) if r[1] in wanted]
    rows = []
    for setup, policy, pins in runs:
        row = await run_one(setup, policy, pins, args, real)
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
        for e in row["errors"]:
            print(f"     error: {e}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    cmd = "./run bench routing " + " ".join(sys.argv[1:])
    (OUT / "routing.json").write_text(json.dumps({"command": cmd, "args": vars(args),
                                                  "rows": rows}, indent=1))
    md = f"`{cmd.strip()}`\n\n{table(rows)}\n"
    (OUT / "routing.md").write_text(md)
    print("\n" + md)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(asyncio.run(main()))
