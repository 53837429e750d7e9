"""Prefix mutations end to end: stock `mlx_lm.server` on a tiny qwen3_next model, prefixd in
front of it, and a 6-turn agent conversation whose system prompt starts with the current time
to the second.

    python bench/mutations.py [--turns 6] [--keep DIR]

Three runs, each on a fresh mlx_lm.server (empty prompt cache) and a fresh prefixd:
  static     the time in the system prompt never moves (the reuse to aim for)
  volatile   the time advances every turn, rules off (relocate_clock_time=off)
  relocate   the time advances, PREFIXD_CANON_RELOCATE_CLOCK_TIME=on
Between prefixd and mlx_lm.server sits a small recorder (in this process) that keeps the last
forwarded body, so the run can check what the model was really sent. Prints a per-turn table
(prompt tokens, cached tokens, X-Prefixd-Prefix) and checks the targets: volatile reuse near 0
with `clock_time` reported at the time's offset; relocate reuse >= 90% of static, and the last
forwarded prompt still states the exact current time. Every process started is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from worker_process import stop  # tests/: stop a process by PID

BLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
SYSTEM_BODY = ("You are a careful coding agent working in a small repository. " * 3 + "\n"
               + "Read the files you need, change the least code that works, and say what you "
               "changed and why in one short paragraph. " * 6)
TASKS = ["look at the cache module", "find where the prefix is stored", "read the window layer",
         "change the state memory", "run the model tests again", "write the reply to the client"]
START = dt.datetime(2026, 11, 22, 1, 37, 5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompt(at: dt.datetime) -> str:
    return f"Current time: {at:%Y-%m-%d %H:%M:%S}\n{SYSTEM_BODY}"


@dataclass
class Row:
    turn: int
    prompt: int
    cached: int
    header: str


@dataclass
class Run:
    name: str
    rows: list[Row] = field(default_factory=list)
    last_forwarded: dict | None = None
    last_time: str = ""

    @property
    def cached(self) -> int:
        return sum(r.cached for r in self.rows)


# --- a recorder between prefixd and mlx_lm.server -------------------------------------------
class Recorder:
    """Relays /v1/* to the upstream and remembers the last request body it forwarded."""

    def __init__(self) -> None:
        self.upstream = ""
        self.last: dict | None = None
        self.session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if request.method == "POST":
            self.last = json.loads(raw)
        assert self.session is not None
        try:
            async with self.session.request(request.method, self.upstream + request.path_qs,
                                            data=raw or None,
                                            headers={"Content-Type": "application/json"}) as r:
                body = await r.read()
                ctype = r.headers.get("Content-Type", "application/json").split(";")[0]
                return web.Response(status=r.status, body=body, content_type=ctype)
        except aiohttp.ClientError as e:      # upstream not up yet: prefixd's health check
            return web.json_response({"error": {"message": str(e)}}, status=502)


async def wait_up(url: str, proc: subprocess.Popen, deadline_s: float) -> None:
    """Until `url` answers 200; fails early if the process already exited."""
    end = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not up after {deadline_s}s")


# --- one run ------------------------------------------------------------------------------------
async def converse(base: str, model: str, run: Run, volatile: bool, turns: int,
                   rec: Recorder) -> None:
    history: list[dict] = []
    headers = {"X-Session-Id": f"bench-{run.name}", "User-Agent": "goose/bench"}
    async with aiohttp.ClientSession() as s:
        for t in range(turns):
            at = START + dt.timedelta(seconds=37 * t if volatile else 0)
            run.last_time = f"{at:%H:%M:%S}"
            user = {"role": "user", "content": TASKS[t % len(TASKS)]}
            body = {"model": model, "temperature": 0.0, "max_tokens": 12,
                    "messages": [{"role": "system", "content": system_prompt(at)}, *history,
                                 user]}
            async with s.post(base + "/v1/chat/completions", json=body, headers=headers) as r:
                data = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"turn {t}: HTTP {r.status}: {data}")
                header = r.headers.get("X-Prefixd-Prefix", "")
            usage = data.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            run.rows.append(Row(t + 1, usage.get("prompt_tokens", 0), cached, header))
            reply = data["choices"][0]["message"]
            history += [user, {"role": "assistant", "content": reply.get("content") or ""}]
    run.last_forwarded = rec.last


async def one_run(name: str, model_dir: Path, rec: Recorder, rec_port: int, turns: int,
                  logs: Path) -> Run:
    env = dict(os.environ)
    if Path(BLAS).exists():
        env["LD_PRELOAD"] = BLAS
    up_port, px_port = free_port(), free_port()
    up_log = (logs / f"{name}-mlx_lm.log").open("w")
    upstream = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir),
                                 "--host", "127.0.0.1", "--port", str(up_port)], env=env,
                                stdout=up_log, stderr=subprocess.STDOUT)
    px_env = dict(os.environ, PREFIXD_PORT=str(px_port), PREFIXD_LOG_LEVEL="DEBUG",
                  PREFIXD_CANON_RELOCATE_CLOCK_TIME="on" if name == "relocate" else "off",
                  PREFIXD_BACKENDS=json.dumps([{
                      "name": "stock", "kind": "openai", "url": f"http://127.0.0.1:{rec_port}",
                      "models": [str(model_dir)]}]))
    px_log = (logs / f"{name}-prefixd.log").open("w")
    # run in the work folder: no stray ./prefixd.env is read
    proxy = subprocess.Popen([sys.executable, "-m", "prefixd.proxy.cli", "serve"], env=px_env,
                             cwd=logs, stdout=px_log, stderr=subprocess.STDOUT)
    try:
        rec.upstream = f"http://127.0.0.1:{up_port}"
        await wait_up(rec.upstream + "/v1/models", upstream, 300)
        await wait_up(f"http://127.0.0.1:{px_port}/health", proxy, 60)
        run = Run(name)
        await converse(f"http://127.0.0.1:{px_port}", str(model_dir), run, name != "static",
                       turns, rec)
        return run
    finally:
        for proc in (proxy, upstream):
            stop(proc)
        up_log.close()
        px_log.close()


def print_run(run: Run) -> None:
    print(f"\n== {run.name}: cached {run.cached} tokens in total")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7}  X-Prefixd-Prefix")
    for r in run.rows:
        print(f"{r.turn:>4} {r.prompt:>7} {r.cached:>7}  {r.header}")


def check(runs: dict[str, Run]) -> list[str]:
    """The targets, as printable verdicts."""
    static, vol, rel = runs["static"], runs["volatile"], runs["relocate"]
    named = True
    for r in vol.rows[1:]:
        a = system_prompt(START + dt.timedelta(seconds=37 * (r.turn - 2)))
        b = system_prompt(START + dt.timedelta(seconds=37 * (r.turn - 1)))
        offset = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        named = named and "clock_time" in r.header and f"at=system[0]+{offset}ch" in r.header
    sent = json.dumps(rel.last_forwarded or {}, ensure_ascii=False)
    system_sent = (rel.last_forwarded or {}).get("messages", [{}])[0].get("content", "")
    return [
        f"volatile reuse {vol.cached} vs static {static.cached}: "
        f"{'OK' if vol.cached <= 0.2 * max(1, static.cached) else 'MISSED'} (target near 0)",
        "volatile reports clock_time at the changed digit of system[0] on turns 2+: "
        f"{'OK' if named else 'MISSED'}",
        f"relocate reuse {rel.cached} = {100 * rel.cached / max(1, static.cached):.0f}% of "
        f"static: {'OK' if rel.cached >= 0.9 * static.cached else 'MISSED'} (target >= 90%)",
        f"last forwarded prompt states {rel.last_time} in the newest turn, not in system: "
        f"{'OK' if rel.last_time in sent and rel.last_time not in system_sent else 'MISSED'}",
    ]


async def main_async(turns: int, keep: Path | None) -> int:
    from prefixd.backends.mlx.model.tiny import save_tiny_model

    work = keep or Path(tempfile.mkdtemp(prefix="prefixd-mutations-"))
    model_dir = work / "tiny-qwen3_next"
    if not (model_dir / "config.json").exists():
        save_tiny_model("qwen3_next", model_dir)
    rec = Recorder()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", rec.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    rec_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", rec_port).start()
    rec.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
    runs: dict[str, Run] = {}
    try:
        for name in ("static", "volatile", "relocate"):
            runs[name] = await one_run(name, model_dir, rec, rec_port, turns, work)
            print_run(runs[name])
    finally:
        await rec.session.close()
        await runner.cleanup()
    last = (runs["relocate"].last_forwarded or {}).get("messages", [{}])[-1]
    print(f"\nrelocate, newest forwarded message:\n{last.get('content')}\n")
    results = check(runs)
    for line in results:
        print(line)
    print(f"(logs in {work})")
    return 0 if all(line.endswith(("OK", "(target near 0)", "(target >= 90%)"))
                    and "MISSED" not in line for line in results) else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--keep", type=Path, help="work folder to reuse (model, logs)")
    args = ap.parse_args()
    sys.exit(asyncio.run(main_async(args.turns, args.keep)))


if __name__ == "__main__":
    main()
