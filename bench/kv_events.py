"""KV events (issue 49 item 5): the routing bench with workers warmed outside the router.

    ./run bench kv_events                                   # built-in SmolLM2-135M, ~10 min
    ./run bench kv_events --model qwen3_next                # the tiny random hybrid, ~3 min
    ./run bench kv_events --quick                           # smoke run: tiny, fewer of all
    ./run bench kv_events --parts routing --scenarios restart --repeats 2
    ./run bench kv_events --parts routing --user-words 200   # longer first user messages

Every process is a subprocess of this one: prefixd workers (`python -m prefixd.backends.mlx`,
`PREFIXD_KV_EVENTS` / `PREFIXD_KV_EVENTS_REPLAY` on loopback ports) and `prefixd serve`
(`python -m prefixd.proxy.cli serve`, `PREFIXD_BACKENDS` of kind "prefixd" by url), each
stopped by its PID at the end, on an error and on Ctrl-C. Model: `--model builtin` (the default:
smollm2-135m-instruct, what `prefixd worker` loads by default, as a float32 folder under
bench/out/models as the other benches load it) or a tiny random architecture written by
`save_tiny_model` (`qwen3_next`: a hybrid, whose recurrent state restores only at checkpoints).

Parts (`--parts`):
routing  Two workers (events on), two `prefixd serve` processes in front of both: "events"
         (its backends have `kv_events`, `kv_events_replay`: it follows both streams) and
         "answers only" (no `kv_events`: it learns only from answers that pass through it).
         A round: `--convs` new conversations, each with its own system prompt
         (`--system-words`: ~1,150 tokens built-in) and a ~30-token first user message
         (`--user-words` adds context to it); their first turns go straight to the workers
         (even ones to w0, odd ones to w1: another router's traffic, direct clients), then,
         `--think` s later, their follow-ups one at a time through one proxy. Scenario
         "direct" as is; "restart": before the follow-ups w1 (the holder of the odd half) is
         stopped (SIGTERM: it writes its cache to its disk tier), and started again on the
         same ports and cache dir (PREFIXD_DISK_CACHE_BYTES set), so its disk tier brings
         them back. Rounds alternate the two proxies (`--repeats` times each scenario). Per
         router: follow-ups served by the worker that holds the conversation; recomputed
         prompt tokens (prompt - cached, summed) against the ideal (prompt - what the holder
         restores: the credit of the holder's stream in this process's own subscriber, which
         is also checked against the cached tokens the holder reports whenever a follow-up
         lands there); over-credit: X-Prefixd-Prefix `predicted=` minus cached where
         positive, summed; the proxy's `event_mispredictions` and its feeds' state in /status.
delay    From the client receiving a direct answer to this process's subscriber (kvevents
         Feed + Held) receiving the batch after which the conversation's follow-up is credited
         all it will be (`--delay-requests` short conversations, alternating w0 / w1, one at
         a time); with the publisher's side (batch `ts` - answer) and the transport (receipt -
         `ts`). Each follow-up is then sent to the same worker: its cached tokens against the
         credit.
cost     Decode throughput (completion tokens after the first / seconds after the first) of
         two fresh workers, one with PREFIXD_KV_EVENTS set and one without, `--cost-runs`
         alternated runs (ABBA), each a new prompt, greedy, `--cost-max-tokens`; the
         announcer's own time (/v1/cache `kv_events.update_s`) over the part.

The proxies run with `route_transfer_min_tokens` 0 (the workers share no transfer secret:
routing alone is compared) and `health_interval_s` 2 on their backends. Writes
bench/out/kv_events.json and bench/out/kv_events.md, logs under bench/out/kv_events-logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multiturn import ensure_model, free_port

from prefixd.kvevents.index import Held
from prefixd.kvevents.subscriber import Feed
from prefixd.kvevents.wire import Batch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
LOGS = OUT / "kv_events-logs"
MODEL = "m"                       # the model name the proxies route (the workers serve any)
START_S = 180.0                   # a worker or proxy that is not ready by then fails the run
REQUEST_S = 600.0
WORDS = ["module", "parser", "request", "handler", "cache", "token", "queue", "backend",
         "index", "prefix", "test", "function", "class", "import", "return", "value", "error",
         "retry", "stream", "socket", "buffer", "worker", "config", "deploy", "metric", "log"]
PROCS: list[subprocess.Popen[bytes]] = []     # every process started here, running or not


# --- processes ------------------------------------------------------------------------------

def spawn(cmd: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT
          ) -> subprocess.Popen[bytes]:
    LOGS.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    PROCS.append(proc)
    return proc


def end(proc: subprocess.Popen[bytes] | None, grace: float = 30.0) -> None:
    """SIGTERM one process started here (by its PID), SIGKILL it after `grace` s."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def end_all() -> None:
    for proc in PROCS:
        with contextlib.suppress(Exception):
            end(proc, 20.0)


def base_env() -> dict[str, str]:
    """This environment without any PREFIXD_* setting (the bench sets its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def free_ports(n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        p = free_port()
        if p not in out:
            out.append(p)
    return out


@dataclass
class Worker:
    name: str
    model: Path
    events: bool
    cache_dir: Path
    ports: list[int] = field(default_factory=lambda: free_ports(3))   # http, events, replay
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.ports[1]}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.ports[2]}"

    def start(self) -> None:
        env = base_env()
        env.update(PREFIXD_CACHE_DIR=str(self.cache_dir), PREFIXD_DISK_CACHE_BYTES=str(4 << 30),
                   PREFIXD_PARENT_PID=str(os.getpid()))
        if self.events:
            env.update(PREFIXD_KV_EVENTS=self.endpoint, PREFIXD_KV_EVENTS_REPLAY=self.replay)
        self.proc = spawn([sys.executable, "-m", "prefixd.backends.mlx", "--model",
                           str(self.model), "--host", "127.0.0.1", "--port", str(self.ports[0])],
                          env, LOGS / f"{self.name}.log")

    async def ready(self, http: aiohttp.ClientSession) -> None:
        await until_ok(http, self.url + "/health", self.proc, self.name)

    async def stop(self) -> None:
        await asyncio.to_thread(end, self.proc)


class Proxy:
    """`prefixd serve` in front of `workers`; `events`: its backends name their streams."""

    def __init__(self, name: str, workers: list[Worker], events: bool) -> None:
        self.name, self.events = name, events
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kv-events-proxy-"))   # no prefixd.env here
        self.backends = [{"name": w.name, "kind": "prefixd", "url": w.url, "models": [MODEL],
                          "health_interval_s": 2,
                          **({"kv_events": w.endpoint, "kv_events_replay": w.replay}
                             if events else {})} for w in workers]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = base_env()
        env.update(PREFIXD_BACKENDS=json.dumps(self.backends), PREFIXD_LOG_LEVEL="INFO",
                   PREFIXD_ROUTE_TRANSFER_MIN_TOKENS="0")
        self.proc = spawn([sys.executable, "-m", "prefixd.proxy.cli", "serve", "--host",
                           "127.0.0.1", "--port", str(self.port)], env,
                          LOGS / f"proxy-{self.name.replace(' ', '-')}.log", cwd=self.dir)

    async def ready(self, http: aiohttp.ClientSession) -> None:
        await until_ok(http, self.url + "/ready", self.proc, f"proxy {self.name}")

    async def stop(self) -> None:
        await asyncio.to_thread(end, self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


async def until_ok(http: aiohttp.ClientSession, url: str,
                   proc: subprocess.Popen[bytes] | None, what: str) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {LOGS}")
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=3)) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{what} not ready after {START_S:.0f} s")


# --- requests -----------------------------------------------------------------------------

async def chat(http: aiohttp.ClientSession, url: str, messages: list[dict], max_tokens: int
               ) -> tuple[dict[str, Any], dict[str, str], float]:
    """A non-streamed chat answer, its headers, and time.time() when it was received."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        text = await r.text()
        got = time.time()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {text[:300]}")
        return json.loads(text), dict(r.headers), got


async def tokenize(http: aiohttp.ClientSession, worker: Worker, messages: list[dict]
                   ) -> list[int]:
    async with http.post(worker.url + "/tokenize",
                         json={"messages": messages, "boundaries": False}) as r:
        return list((await r.json())["tokens"])


async def get(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url) as r:
        return dict(await r.json())


def reply_of(answer: dict[str, Any]) -> dict[str, str]:
    return {"role": "assistant", "content": answer["choices"][0]["message"].get("content") or ""}


def cached_of(answer: dict[str, Any]) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def predicted_of(headers: dict[str, str]) -> int | None:
    for part in headers.get("X-Prefixd-Prefix", "").split(";"):
        if part.startswith("predicted="):
            with contextlib.suppress(ValueError):
                return int(part.split("=", 1)[1])
    return None


def system_prompt(tag: str, words: int) -> str:
    rng = random.Random(tag)
    lines = [f"You are agent {tag}, a coding agent in repository {tag.replace(' ', '-')}. "
             "Follow these rules exactly."]
    n, i = len(lines[0].split()), 0
    while n < words:
        i += 1
        line = f"Rule {i}: " + " ".join(rng.choice(WORDS) for _ in range(10)) + "."
        lines.append(line)
        n += len(line.split())
    return "\n".join(lines)


def first_turn(tag: str, words: int, user_words: int = 0) -> list[dict]:
    """A conversation's first turn: its own system prompt, a short task (~30 tokens) and
    `user_words` more words of context in the same user message."""
    rng = random.Random(tag + "/user")
    extra = (" Context: " + " ".join(rng.choice(WORDS) for _ in range(user_words))
             if user_words else "")
    return [{"role": "system", "content": system_prompt(tag, words)},
            {"role": "user", "content": f"Task {tag}: name the two rules above that matter "
             f"most for the {rng.choice(WORDS)} {rng.choice(WORDS)}, in one sentence.{extra}"}]


def follow_up(messages: list[dict], reply: dict[str, str], tag: str) -> list[dict]:
    rng = random.Random(tag + "/next")
    return [*messages, reply, {"role": "user", "content": f"Now apply rule {rng.randint(1, 40)}"
                               f" to src/{rng.choice(WORDS)}.py and say what changed."}]


# --- this process's own subscriber --------------------------------------------------------

class Watch:
    """A subscription to one worker's stream (kvevents Feed into a Held), every batch it
    applied logged with its receipt time."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.held = Held()
        self.log: list[tuple[float, int, Batch]] = []       # (receipt time.time(), seq, batch)
        self.feed = Feed(worker.name, worker.endpoint, self.held, worker.replay,
                         on_batch=self._applied)
        self.feed.start()

    def _applied(self, feed: Feed, batch: Batch) -> None:
        self.log.append((time.time(), feed.status.last_seq or 0, batch))

    async def settled(self, http: aiohttp.ClientSession, quiet: float = 0.3,
                      deadline: float = 10.0) -> bool:
        """Until this feed has applied every batch the worker sent and nothing came for
        `quiet` s since the call or the last batch (a change the worker is still publishing
        is not counted in /v1/cache yet); False if not by `deadline` s."""
        stop, called = time.monotonic() + deadline, time.time()
        while time.monotonic() < stop:
            info = (await get(http, self.worker.url + "/v1/cache")).get("kv_events") or {}
            last = self.feed.status.last_seq
            heard = max(self.log[-1][0] if self.log else 0.0, called)
            if last is not None and last == info.get("batches", 0) - 1 and \
                    time.time() - heard >= quiet:
                return True
            await asyncio.sleep(0.05)
        return False

    async def stop(self) -> None:
        await self.feed.stop()


# --- part 1: routing --------------------------------------------------------------------------

@dataclass
class FollowUp:
    conv: str
    holder: str
    backend: str
    prompt: int
    cached: int
    predicted: int | None
    ideal_cached: int             # the holder's credit in this process's subscriber
    landed_credit: int            # the same, of the worker that served it
    seconds: float


async def proxy_feeds(http: aiohttp.ClientSession, proxy: Proxy) -> dict[str, Any]:
    status = await get(http, proxy.url + "/status")
    return {b["name"]: {"up": b.get("up"), "kv_events": b.get("kv_events"),
                        "event_mispredictions": (b.get("index") or {}).get(
                            "event_mispredictions", 0),
                        "mispredictions": (b.get("index") or {}).get("mispredictions", 0)}
            for b in status["backends"]}


async def restart(http: aiohttp.ClientSession, w: Worker, watches: dict[str, Watch]
                  ) -> dict[str, float]:
    """SIGTERM `w` (it writes its cache to disk), wait for it to exit, start it again on the
    same ports and cache dir; this process's subscriber starts anew on its new stream."""
    t0 = time.monotonic()
    await w.stop()
    stopped = time.monotonic() - t0
    await watches[w.name].stop()
    w.start()
    await w.ready(http)
    watches[w.name] = Watch(w)          # a quiet stream: the feed asks its replay endpoint
    await watches[w.name].settled(http)
    return {"stop_s": round(stopped, 2), "down_s": round(time.monotonic() - t0, 2)}


async def all_up(http: aiohttp.ClientSession, proxy: Proxy, deadline: float = 30.0) -> float:
    """Seconds until the proxy reports every backend up."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline:
        if all(f["up"] for f in (await proxy_feeds(http, proxy)).values()):
            break
        await asyncio.sleep(0.2)
    return time.monotonic() - t0


async def routing_round(http: aiohttp.ClientSession, args: argparse.Namespace,
                        workers: list[Worker], watches: dict[str, Watch], proxy: Proxy,
                        scenario: str, rep: int) -> dict[str, Any]:
    tags = [f"{scenario[0]}{rep}{'e' if proxy.events else 'a'}{i}" for i in range(args.convs)]
    firsts = {t: first_turn(t, args.system_words, args.user_words) for t in tags}
    holder = {t: workers[i % 2] for i, t in enumerate(tags)}
    replies: dict[str, dict[str, str]] = {}
    t0 = time.monotonic()

    async def warm(w: Worker) -> None:          # one worker's share, one at a time
        for t in tags:
            if holder[t] is w:
                answer, _, _ = await chat(http, w.url, firsts[t], args.first_max_tokens)
                replies[t] = reply_of(answer)

    await asyncio.gather(*(warm(w) for w in workers))
    warm_s = time.monotonic() - t0
    events: dict[str, Any] = {}
    if scenario == "restart":
        events = await restart(http, workers[1], watches)
        events["proxy_up_s"] = round(await all_up(http, proxy), 2)
    await asyncio.sleep(args.think)
    for w in workers:
        await watches[w.name].settled(http)
    before = await proxy_feeds(http, proxy)
    by_name = {w.name: w for w in workers}
    rows: list[FollowUp] = []
    for t in tags:
        msgs = follow_up(firsts[t], replies[t], t)
        tokens = await tokenize(http, holder[t], msgs)
        credit = {n: watches[n].held.held(tokens) for n in by_name}
        s0 = time.monotonic()
        answer, headers, _ = await chat(http, proxy.url, msgs, args.follow_max_tokens)
        backend = headers.get("X-Prefixd-Backend", "?")
        rows.append(FollowUp(t, holder[t].name, backend, int(answer["usage"]["prompt_tokens"]),
                             cached_of(answer), predicted_of(headers), credit[holder[t].name],
                             credit.get(backend, 0), time.monotonic() - s0))
    after = await proxy_feeds(http, proxy)
    on = [r for r in rows if r.backend == r.holder]
    return {
        "scenario": scenario, "router": proxy.name, "rep": rep, "convs": len(rows),
        "on_holder": len(on), "recomputed": sum(r.prompt - r.cached for r in rows),
        "ideal": sum(r.prompt - r.ideal_cached for r in rows),
        "prompt": sum(r.prompt for r in rows),
        "over_credit": sum(max(0, (r.predicted or 0) - r.cached) for r in rows),
        "under_credit_on_holder": sum(max(0, r.cached - (r.predicted or 0)) for r in on),
        "credit_eq_cached": f"{sum(r.landed_credit == r.cached for r in rows)}/{len(rows)}",
        "event_mispredictions": sum(f["event_mispredictions"] - before[n]["event_mispredictions"]
                                    for n, f in after.items()),
        "feeds_before": {n: f["kv_events"] for n, f in before.items()},
        "feeds_after": {n: f["kv_events"] for n, f in after.items()},
        "followup_s_p50": statistics.median(r.seconds for r in rows),
        "warm_s": round(warm_s, 1), "restart": events,
        "rows": [r.__dict__ for r in rows]}


async def part_routing(http: aiohttp.ClientSession, args: argparse.Namespace,
                       workers: list[Worker], watches: dict[str, Watch]) -> list[dict[str, Any]]:
    proxies = [Proxy("events", workers, True), Proxy("answers only", workers, False)]
    out = []
    try:
        for p in proxies:
            p.start()
        for p in proxies:
            await p.ready(http)
        for rep in range(args.repeats):
            for scenario in args.scenarios:
                order = proxies if (rep + len(out) // 2) % 2 == 0 else proxies[::-1]
                for p in order:
                    t0 = time.monotonic()
                    row = await routing_round(http, args, workers, watches, p, scenario, rep)
                    out.append(row)
                    print(f"  routing {scenario:7} {p.name:12} on holder {row['on_holder']}/"
                          f"{row['convs']} recomputed {row['recomputed']} (ideal "
                          f"{row['ideal']}) over-credit {row['over_credit']} credit=cached "
                          f"{row['credit_eq_cached']} {row['restart'] or ''} "
                          f"({time.monotonic() - t0:.0f} s)", flush=True)
                    for name, f in row["feeds_before"].items():
                        if f is not None:
                            print(f"      {name} feed before follow-ups: {f['state']} "
                                  f"last_seq {f['last_seq']} blocks {f['blocks']} "
                                  f"restarts {f['counts'].get('restarts', 0)}", flush=True)
    finally:
        for p in proxies:
            await p.stop()
    return out


# --- part 2: event delay -------------------------------------------------------------------

async def part_delay(http: aiohttp.ClientSession, args: argparse.Namespace,
                     workers: list[Worker], watches: dict[str, Watch]) -> list[dict[str, Any]]:
    cursors = {w.name: (Held(), [0]) for w in workers}   # the stream replayed batch by batch
    out = []
    for k in range(args.delay_requests):
        w = workers[k % 2]
        watch = watches[w.name]
        mark = len(watch.log)
        tag = f"delay{k}"
        msgs = first_turn(tag, args.delay_words)
        answer, _, t_answer = await chat(http, w.url, msgs, args.first_max_tokens)
        nxt = follow_up(msgs, reply_of(answer), tag)
        tokens = await tokenize(http, w, nxt)
        settled = await watch.settled(http, quiet=0.3)
        final = watch.held.held(tokens)
        held, at = cursors[w.name]
        while at[0] < mark:                 # the stream as it was when the request was sent
            for e in watch.log[at[0]][2].events:
                held.apply(e)
            at[0] += 1
        hit: tuple[float, int, Batch] | None = None
        while at[0] < len(watch.log):
            entry = watch.log[at[0]]
            for e in entry[2].events:
                held.apply(e)
            at[0] += 1
            if hit is None and final > 0 and held.held(tokens) >= final:
                hit = entry
        again, _, _ = await chat(http, w.url, nxt, 1)
        while at[0] < len(watch.log):        # the follow-up's own batches: not measured
            for e in watch.log[at[0]][2].events:
                held.apply(e)
            at[0] += 1
        await watch.settled(http, quiet=0.1)
        row = {"worker": w.name, "prompt": int(answer["usage"]["prompt_tokens"]),
               "credit": final, "cached_next": cached_of(again), "settled": settled,
               "batches": len(watch.log) - mark}
        if hit is not None:
            row |= {"delay_ms": 1000 * (hit[0] - t_answer),
                    "publish_ms": 1000 * (hit[2].ts - t_answer),
                    "transport_ms": 1000 * (hit[0] - hit[2].ts)}
        out.append(row)
    return out


# --- part 3: what publishing costs ---------------------------------------------------------

STORIES = ["a dragon who learns to program", "a lighthouse keeper and a storm",
           "a robot that repairs clocks", "two rival bakers in a small town",
           "a cartographer mapping an island that moves", "a cat that runs a library",
           "an astronaut growing tomatoes on Mars", "a detective who is afraid of the dark"]


def cpu_s(w: Worker) -> float:
    """The worker process's CPU time so far (user + system, every thread)."""
    assert w.proc is not None
    t = psutil.Process(w.proc.pid).cpu_times()
    return t.user + t.system


async def decode_rate(http: aiohttp.ClientSession, w: Worker, prompt: str, max_tokens: int
                      ) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    first = last = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with http.post(w.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    last = time.perf_counter()
                    first = first or last
                    text.append(piece)
    n = int(usage.get("completion_tokens", 0))
    seconds = (last or 0.0) - (first or 0.0)
    return {"tokens": n, "seconds": seconds,
            "rate": (n - 1) / seconds if n > 1 and seconds > 0 else 0.0,
            "reply": "".join(text)}


async def part_cost(http: aiohttp.ClientSession, args: argparse.Namespace, model: Path,
                    root: Path) -> dict[str, Any]:
    on = Worker("events-on", model, True, root / "cost-on")
    off = Worker("events-off", model, False, root / "cost-off")
    try:
        for w in (on, off):
            w.start()
        for w in (on, off):
            await w.ready(http)
            await chat(http, w.url, first_turn(f"warm {w.name}", 60), 8)
        start = (await get(http, on.url + "/v1/cache"))["kv_events"]
        runs: dict[str, list[dict[str, Any]]] = {"events-on": [], "events-off": []}
        for r in range(args.cost_runs):
            prompt = (f"Write a long story about {STORIES[r % len(STORIES)]} (run {r}). "
                      "Make it at least 600 words, with dialogue.")
            for w in ((on, off) if r % 2 == 0 else (off, on)):
                cpu0 = cpu_s(w)
                got = await decode_rate(http, w, prompt, args.cost_max_tokens)
                got["cpu_ms_per_token"] = 1000 * (cpu_s(w) - cpu0) / max(1, got["tokens"])
                runs[w.name].append(got)
                print(f"  cost run {r + 1}: {w.name:10} {got['tokens']} tokens "
                      f"{got['rate']:.1f} tok/s", flush=True)
        await asyncio.sleep(0.5)
        end_info = (await get(http, on.url + "/v1/cache"))["kv_events"]
    finally:
        for w in (on, off):
            await w.stop()
    same = sum(a["reply"] == b["reply"] for a, b in zip(runs["events-on"], runs["events-off"],
                                                       strict=True))
    med = {k: statistics.median(x["rate"] for x in v) for k, v in runs.items()}
    pairs = [a["rate"] / b["rate"] for a, b in zip(runs["events-on"], runs["events-off"],
                                                    strict=True) if b["rate"]]
    cpu = {k: statistics.median(x["cpu_ms_per_token"] for x in v) for k, v in runs.items()}
    decode_s = sum(x["seconds"] for x in runs["events-on"])
    return {"runs": {k: [{kk: vv for kk, vv in x.items() if kk != "reply"} for x in v]
                     for k, v in runs.items()},
            "median_rate": med, "ratio": med["events-on"] / max(1e-9, med["events-off"]),
            "paired_ratio_median": statistics.median(pairs) if pairs else 0.0,
            "cpu_ms_per_token": cpu,
            "replies_equal": f"{same}/{args.cost_runs}",
            "update_s": end_info["update_s"] - start["update_s"],
            "updates": end_info["updates"] - start["updates"],
            "batches": end_info["batches"] - start["batches"],
            "decode_s_events_on": decode_s,
            "announced_end": end_info["announced"]}


# --- tables -------------------------------------------------------------------------------

def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def routing_table(rows: list[dict[str, Any]]) -> str:
    out = ["| scenario | router | follow-ups on the holder | recomputed / ideal tokens | "
           "over-credited tokens | event mispredictions | holder's credit = its cached | "
           "follow-up s p50 | the router's feed of w1 before the follow-ups |",
           "|---|---|---|---|---|---|---|---|---|"]
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        for router in ("events", "answers only"):
            mine = [r for r in rows if r["scenario"] == scenario and r["router"] == router]
            if not mine:
                continue
            n = sum(r["convs"] for r in mine)
            on = sum(r["on_holder"] for r in mine)
            rec, ideal = sum(r["recomputed"] for r in mine), sum(r["ideal"] for r in mine)
            held_rows = [x for r in mine for x in r["rows"] if x["backend"] == x["holder"]]
            eq = sum(x["ideal_cached"] == x["cached"] for x in held_rows)
            out.append(f"| {scenario} | {router} | {on}/{n} ({100 * on / max(1, n):.0f}%) | "
                       f"{rec} / {ideal} ({rec / max(1, ideal):.2f}x) | "
                       f"{sum(r['over_credit'] for r in mine)} | "
                       f"{sum(r['event_mispredictions'] for r in mine)} | "
                       f"{eq}/{len(held_rows)} | "
                       f"{statistics.median(r['followup_s_p50'] for r in mine):.2f} | "
                       f"{'; '.join(feed_summary(r['feeds_before'].get('w1')) for r in mine)} |")
    return "\n".join(out)


def feed_summary(feed: dict[str, Any] | None) -> str:
    """A followed stream as /status showed it: state, blocks per medium, restarts seen."""
    if feed is None:
        return "-"
    blocks = ", ".join(f"{k} {v}" for k, v in sorted(feed["blocks"].items())) or "no blocks"
    return f"{feed['state']}, {blocks}, {feed['counts'].get('restarts', 0)} restarts seen"


def delay_table(rows: list[dict[str, Any]]) -> str:
    hit = [r for r in rows if "delay_ms" in r]
    out = ["| requests | stored batch seen | delay from the answer ms: median / p95 / max | "
           "publisher (batch ts - answer) ms: median / max | transport (receipt - ts) ms: "
           "median / max | follow-up cached = credit |", "|---|---|---|---|---|---|"]
    if not hit:
        return "\n".join([*out, f"| {len(rows)} | 0 | - | - | - | - |"])
    d = [r["delay_ms"] for r in hit]
    p = [r["publish_ms"] for r in hit]
    t = [r["transport_ms"] for r in hit]
    eq = sum(r["cached_next"] == r["credit"] for r in rows)
    out.append(f"| {len(rows)} | {len(hit)} | {statistics.median(d):.1f} / {pct(d, 0.95):.1f}"
               f" / {max(d):.1f} | {statistics.median(p):.1f} / {max(p):.1f} | "
               f"{statistics.median(t):.2f} / {max(t):.2f} | {eq}/{len(rows)} |")
    return "\n".join(out)


def cost_table(c: dict[str, Any]) -> str:
    rates = {k: ", ".join(f"{x['rate']:.1f}" for x in v) for k, v in c["runs"].items()}
    share = c["update_s"] / max(1e-9, c["decode_s_events_on"])
    cpu = c["cpu_ms_per_token"]
    return "\n".join([
        "| worker | decode tok/s per run | median | vs events off: medians, run pairs "
        "(median) | worker CPU ms per token (median) | announcer time (update_s) / decode "
        "time | replies equal |", "|---|---|---|---|---|---|---|",
        f"| PREFIXD_KV_EVENTS set | {rates['events-on']} | {c['median_rate']['events-on']:.1f} "
        f"| **{c['ratio']:.3f}x**, {c['paired_ratio_median']:.3f}x | {cpu['events-on']:.1f} "
        f"| {c['update_s'] * 1000:.1f} ms / {c['decode_s_events_on']:.1f} s "
        f"({100 * share:.3f}%; {c['updates']} updates, {c['batches']} batches) "
        f"| {c['replies_equal']} |",
        f"| unset | {rates['events-off']} | {c['median_rate']['events-off']:.1f} | 1 "
        f"| {cpu['events-off']:.1f} | - | |"])


# --- main ---------------------------------------------------------------------------------

async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model(args)
    root = Path(tempfile.mkdtemp(prefix="kv-events-bench-"))
    result: dict[str, Any] = {"model": args.model, "model_dir": str(model)}
    timeout = aiohttp.ClientTimeout(total=REQUEST_S)
    workers = [Worker(f"w{i}", model, True, root / f"w{i}") for i in range(2)]
    watches: dict[str, Watch] = {}
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            if "delay" in args.parts or "routing" in args.parts:
                for w in workers:
                    w.start()
                for w in workers:
                    await w.ready(http)
                    await chat(http, w.url, first_turn(f"warm {w.name}", 60), 4)
                    watches[w.name] = Watch(w)
                for w in workers:
                    await watches[w.name].settled(http)
                t0 = time.monotonic()
                if "delay" in args.parts:
                    result["delay"] = await part_delay(http, args, workers, watches)
                    print(f"delay ({time.monotonic() - t0:.0f} s):\n"
                          f"{delay_table(result['delay'])}\n", flush=True)
                t0 = time.monotonic()
                if "routing" in args.parts:
                    result["routing"] = await part_routing(http, args, workers, watches)
                    print(f"routing ({time.monotonic() - t0:.0f} s):\n"
                          f"{routing_table(result['routing'])}\n", flush=True)
                for w in workers:
                    with contextlib.suppress(Exception):
                        await watches[w.name].stop()
                    await w.stop()
            if "cost" in args.parts:
                t0 = time.monotonic()
                result["cost"] = await part_cost(http, args, model, root)
                print(f"cost ({time.monotonic() - t0:.0f} s):\n{cost_table(result['cost'])}\n",
                      flush=True)
    finally:
        for watch in watches.values():
            with contextlib.suppress(Exception):
                await watch.stop()
        await asyncio.to_thread(end_all)
        shutil.rmtree(root, ignore_errors=True)
    return result


def resolve_model(args: argparse.Namespace) -> Path:
    if args.model == "builtin":
        from interactive import builtin_f32
        return builtin_f32(argparse.Namespace(models_dir=OUT / "models",
                                              cache_dir=args.cache_dir))
    return ensure_model(args.model, OUT / "models")


def markdown(args: argparse.Namespace, result: dict[str, Any], cmd: str, wall: float) -> str:
    out = [f"`{cmd}` ({wall / 60:.1f} min; model {args.model})\n"]
    if "routing" in result:
        out += [f"Routing ({args.convs} conversations a round, ~{args.system_words}-word system"
                f" prompts, {args.repeats} round(s) per scenario and router):\n",
                routing_table(result["routing"]), ""]
    if "delay" in result:
        out += ["Event delay:\n", delay_table(result["delay"]), ""]
    if "cost" in result:
        out += [f"Publishing cost ({args.cost_runs} alternated runs, max_tokens "
                f"{args.cost_max_tokens}):\n", cost_table(result["cost"]), ""]
    return "\n".join(out)


def git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True,
                          check=False).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin",
                    help="builtin (smollm2-135m-instruct) or a tiny architecture (qwen3_next)")
    ap.add_argument("--parts", default="delay,routing,cost")
    ap.add_argument("--scenarios", default="direct,restart")
    ap.add_argument("--repeats", type=int, default=1, help="rounds per scenario and router")
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=None,
                    help="words of each system prompt (default: ~1,000 tokens built-in, "
                    "~1,500 tiny)")
    ap.add_argument("--user-words", type=int, default=0,
                    help="words of context added to each first user message (default: none, "
                    "a ~30-token task)")
    ap.add_argument("--first-max-tokens", type=int, default=8)
    ap.add_argument("--follow-max-tokens", type=int, default=4)
    ap.add_argument("--think", type=float, default=1.0,
                    help="seconds between the last first turn (or the restart) and the "
                    "follow-ups")
    ap.add_argument("--delay-requests", type=int, default=20)
    ap.add_argument("--delay-words", type=int, default=80)
    ap.add_argument("--cost-runs", type=int, default=4, help="runs per worker (alternated)")
    ap.add_argument("--cost-max-tokens", type=int, default=256)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny hybrid, 4 conversations, 6 delay requests, 2 cost runs"
                    " of 64 tokens")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path(os.environ.get("PREFIXD_CACHE_DIR", "~/.cache/prefixd"))
                    .expanduser(), help="where the built-in model is converted")
    args = ap.parse_args()
    if args.quick:
        args.model = "qwen3_next" if args.model == "builtin" else args.model
        args.convs, args.delay_requests, args.cost_runs = 4, 6, 2
        args.cost_max_tokens = 64
    if args.system_words is None:
        args.system_words = 800 if args.model == "builtin" else 450
    args.parts = args.parts.split(",")
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    cmd = "./run bench kv_events " + " ".join(sys.argv[1:])
    shutil.rmtree(LOGS, ignore_errors=True)
    commit = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", "."))
    # Ctrl-C and SIGTERM end the run the same way (SIGINT too where a shell ignored it)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    t0 = time.monotonic()
    try:
        result = asyncio.run(run(args))
    except KeyboardInterrupt:
        print("interrupted: every process started here stopped", file=sys.stderr)
        return 130
    finally:
        end_all()
    wall = time.monotonic() - t0
    md = markdown(args, result, cmd.strip(), wall) + \
        f"\nCode: {commit}{' with uncommitted changes' if dirty else ''}.\n"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "kv_events.json").write_text(json.dumps({"command": cmd, "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seconds": wall, "commit": commit, "dirty": dirty, **result}, indent=1, default=str))
    (OUT / "kv_events.md").write_text(md)
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
