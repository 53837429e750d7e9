"""Soak: minutes of mixed, hostile load on a real `prefixd serve`, then the ledger.

    ./run bench soak [--minutes 20] [--kill-every 60]

prefixd runs as a subprocess with two backends: `fake` (an OpenAI-shaped upstream in this
process that records every request id it receives, so a duplicate is seen) and `tiny` (a
managed mlx worker on a tiny random-weight qwen3 model, which this script SIGKILLs every
`--kill-every` seconds). The load, all at once: streaming and plain requests to both, clients
that disconnect mid-stream, malformed bodies, and slow clients that trickle their headers.

Printed at the end: requests by outcome, lost (no status, or a stream that neither ended
nor carried an error event), duplicated (an id the upstream saw twice), worker restarts,
and the proxy's RSS and open fds at start, after warm-up and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil
from aiohttp import web


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Upstream:
    """OpenAI-shaped, records each request id; streams a few chunks slowly."""

    def __init__(self) -> None:
        self.seen: collections.Counter[str] = collections.Counter()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen[body.get("user", "?")] += 1
        if not body.get("stream"):
            await asyncio.sleep(0.01)
            return web.json_response({"id": "c", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(20):
                chunk = {"choices": [{"index": 0, "delta": {"content": "tok "}}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(0.01)
            usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 20}}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        except ConnectionResetError:      # the client (prefixd) cut the stream: expected
            pass
        return resp


class Ledger:
    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.lost: list[str] = []

    def note(self, kind: str, outcome: str) -> None:
        self.outcomes[f"{kind}:{outcome}"] += 1


async def one_request(http: aiohttp.ClientSession, base: str, ledger: Ledger, rid: str,
                      model: str, stream: bool, disconnect: bool) -> None:
    body = {"model": model, "stream": stream, "user": rid, "max_tokens": 8,
            "messages": [{"role": "user", "content": f"say something {rid}"}]}
    kind = f"{model}/{'stream' if stream else 'plain'}{'/cut' if disconnect else ''}"
    try:
        async with http.post(base + "/v1/chat/completions", json=body) as r:
            if disconnect:
                await r.content.readany()
                ledger.note(kind, "cut")
                return
            data = await asyncio.wait_for(r.read(), 120)
            if r.status != 200:
                ledger.note(kind, str(r.status))
                return
            if stream and not data.rstrip().endswith(b"data: [DONE]"):
                ledger.lost.append(f"{rid}: stream without an end")
                ledger.note(kind, "lost")
            elif stream and b'"error"' in data:
                ledger.note(kind, "200+error_event")
            else:
                ledger.note(kind, "200")
    except (TimeoutError, aiohttp.ClientError) as e:
        ledger.lost.append(f"{rid}: {type(e).__name__}")
        ledger.note(kind, "lost")


async def bad_body(http: aiohttp.ClientSession, base: str, ledger: Ledger) -> None:
    raw = random.choice([b"{not json", b'{"messages": 5}', b"\xff\xfe", b"[]",
                         b'{"model": "fake", "messages": [{"role": "user", '
                         b'"content": "\\ud800"}]}'])
    async with http.post(base + "/v1/chat/completions", data=raw,
                         headers={"Content-Type": "application/json"}) as r:
        await r.read()
        ledger.note("bad_body", str(r.status))


async def slow_client(port: int, ledger: Ledger) -> None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        ledger.note("slow_client", "refused")
        return
    try:
        for part in (b"POST /v1/chat/", b"completions HTTP/1.1\r\n", b"Host: x\r\n"):
            writer.write(part)
            await writer.drain()
            try:                          # the proxy closing the connection ends the read
                if await asyncio.wait_for(reader.read(1), 4) == b"":
                    ledger.note("slow_client", "closed_by_proxy")
                    return
            except TimeoutError:
                pass
        ledger.note("slow_client", "kept")
    except OSError:
        ledger.note("slow_client", "closed_by_proxy")
    finally:
        writer.close()


def proxy_stats(pid: int) -> dict[str, float]:
    p = psutil.Process(pid)
    return {"rss_mib": round(p.memory_info().rss / 2**20, 1), "fds": p.num_fds()}


def worker_pid(pid: int) -> int | None:
    for child in psutil.Process(pid).children(recursive=True):
        if "prefixd.backends.mlx" in " ".join(child.cmdline()):
            return child.pid
    return None


async def main(args: argparse.Namespace) -> None:
    up = Upstream()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", up.chat)
    app.router.add_get("/v1/models", lambda r: web.json_response({"data": []}))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    up_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", up_port).start()

    tmp = Path(tempfile.mkdtemp(prefix="prefixd-soak-"))
    model = tmp / "tiny-qwen3"
    subprocess.run([sys.executable, "-m", "prefixd.proxy.cli", "tiny-model", "qwen3",
                    str(model)], check=True)
    port = free_port()
    backends = [{"name": "fake", "kind": "openai", "url": f"http://127.0.0.1:{up_port}",
                 "models": ["fake"], "max_concurrency": 4},
                {"name": "tiny", "kind": "mlx", "model": str(model), "models": ["tiny"],
                 "max_restarts": 1000}]
    env = {**os.environ, "PREFIXD_BACKENDS": json.dumps(backends), "PREFIXD_PORT": str(port),
           "PREFIXD_LOG_LEVEL": "WARNING", "PREFIXD_CACHE_BYTES": str(64 * 2**20),
           "PREFIXD_HEADER_TIMEOUT_S": "5"}
    log_file = open(tmp / "prefixd.log", "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen([sys.executable, "-m", "prefixd.proxy.cli", "serve"], env=env,
                            stdout=subprocess.DEVNULL, stderr=log_file)
    base = f"http://127.0.0.1:{port}"
    ledger = Ledger()
    kills = 0
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
            deadline = time.monotonic() + 120
            while True:
                try:
                    async with http.get(base + "/ready") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("prefixd did not become ready")
                await asyncio.sleep(0.5)
            start = proxy_stats(proc.pid)
            warm: dict[str, float] | None = None
            t0 = time.monotonic()
            end = t0 + args.minutes * 60
            next_kill = t0 + args.kill_every
            n = 0
            tasks: set[asyncio.Task] = set()
            while time.monotonic() < end:
                n += 1
                roll = random.random()
                if roll < 0.55:
                    coro = one_request(http, base, ledger, f"r{n}", "fake", random.random() < 0.7,
                                       random.random() < 0.15)
                elif roll < 0.8:
                    coro = one_request(http, base, ledger, f"r{n}", "tiny", random.random() < 0.7,
                                       random.random() < 0.15)
                elif roll < 0.92:
                    coro = bad_body(http, base, ledger)
                else:
                    coro = slow_client(port, ledger)
                task = asyncio.create_task(coro)
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                if time.monotonic() > next_kill:
                    wpid = worker_pid(proc.pid)
                    if wpid:
                        os.kill(wpid, signal.SIGKILL)
                        kills += 1
                    next_kill += args.kill_every
                if warm is None and time.monotonic() - t0 > 60:
                    warm = proxy_stats(proc.pid)
                await asyncio.sleep(1 / args.rate)
            await asyncio.wait(tasks, timeout=300)
            async with http.get(base + "/status") as r:
                status = await r.json()
        await asyncio.sleep(2)        # our pooled keep-alive connections are closed now
        final = proxy_stats(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = -9
        await runner.cleanup()
        log_file.close()
    dups = {k: v for k, v in up.seen.items() if v > 1}
    restarts = {b["name"]: b.get("restarts") for b in status["backends"]}
    print(f"\nsoak: {args.minutes:g} min, {sum(ledger.outcomes.values())} requests, "
          f"{kills} worker SIGKILLs, prefixd exit {rc}")
    print("| outcome | count |\n|---|---|")
    for k, v in sorted(ledger.outcomes.items()):
        print(f"| {k} | {v} |")
    print(f"\nlost: {len(ledger.lost)} {ledger.lost[:5]}")
    print(f"duplicated (upstream saw an id twice): {len(dups)} {list(dups)[:5]}")
    print(f"worker restarts: {restarts}")
    print(f"proxy RSS/fds: start {start}, after 1 min {warm}, end {final}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--kill-every", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=8.0, help="new requests per second")
    asyncio.run(main(ap.parse_args()))
