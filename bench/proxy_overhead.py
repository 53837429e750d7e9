"""What prefixd adds on the wire: the same workload sent straight to a loopback upstream and
through prefixd, in one run.

    ./run bench proxy_overhead [--requests 2000] [--chunks 100000]

Three processes: a minimal OpenAI-shaped upstream (this file, `--upstream`), `prefixd serve`
in front of it, and this client. Prints p50/p99 latency per request (direct, proxied, added)
at concurrency 1, and SSE chunks/s for one long stream (direct and relayed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import aiohttp
from aiohttp import web

CHUNK = {"id": "c", "object": "chat.completion.chunk",
         "choices": [{"index": 0, "delta": {"content": "tok "}}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the upstream (runs in its own process) ---------------------------------------------
async def _chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        return web.json_response({"id": "c", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"},
             "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    event = b"data: " + json.dumps(CHUNK).encode() + b"\n\n"
    n = int(body.get("n_chunks", 1000))
    batch = 64  # write in batches so the upstream itself is not the bottleneck
    for i in range(0, n, batch):
        await resp.write(event * min(batch, n - i))
    await resp.write(b"data: [DONE]\n\n")
    return resp


def run_upstream(port: int) -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", lambda r: web.json_response({"data": []}))
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- the client ---------------------------------------------------------------------------
async def wait_up(url: str, deadline_s: float = 30) -> None:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
        while time.monotonic() - t0 < deadline_s:
            try:
                async with s.get(url) as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def latencies(base: str, n: int) -> list[float]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}
    out = []
    async with aiohttp.ClientSession() as s:
        for i in range(n + 50):
            t0 = time.perf_counter()
            async with s.post(base + "/v1/chat/completions", json=body) as r:
                await r.read()
            if i >= 50:              # warm-up excluded
                out.append(time.perf_counter() - t0)
    return out


async def stream_rate(base: str, n_chunks: int) -> float:
    body = {"model": "m", "stream": True, "n_chunks": n_chunks,
            "messages": [{"role": "user", "content": "go"}]}
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        got, tail = 0, b""
        async with s.post(base + "/v1/chat/completions", json=body) as r:
            async for data in r.content.iter_any():
                got += (tail + data).count(b"\n\n")    # an event end split across reads
                tail = data[-1:]
        dt = time.perf_counter() - t0
    assert got >= n_chunks, (got, n_chunks)
    return n_chunks / dt


def pct(xs: list[float], p: float) -> float:
    return statistics.quantiles(xs, n=100)[int(p) - 1] if p < 100 else max(xs)


async def bench(requests: int, chunks: int) -> None:
    up_port, px_port = free_port(), free_port()
    env = {**os.environ, "PREFIXD_BACKENDS": json.dumps(
        [{"name": "up", "url": f"http://127.0.0.1:{up_port}", "models": ["m"]}]),
        "PREFIXD_LOG_LEVEL": "WARNING"}
    procs = [subprocess.Popen([sys.executable, __file__, "--upstream", str(up_port)]),
             subprocess.Popen([sys.executable, "-m", "prefixd.proxy.cli", "serve", "--port",
                               str(px_port)], env=env)]
    try:
        direct, proxied = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{px_port}"
        await wait_up(direct + "/v1/models")
        await wait_up(proxied + "/health")
        d = await latencies(direct, requests)
        p = await latencies(proxied, requests)
        rd = await stream_rate(direct, chunks)
        rp = await stream_rate(proxied, chunks)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    ms = 1000
    print(f"\nproxy overhead, {requests} sequential non-stream requests (concurrency 1)")
    print(f"{'':10}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'direct':10}{pct(d, 50) * ms:10.3f}{pct(d, 99) * ms:10.3f}")
    print(f"{'prefixd':10}{pct(p, 50) * ms:10.3f}{pct(p, 99) * ms:10.3f}")
    print(f"{'added':10}{(pct(p, 50) - pct(d, 50)) * ms:10.3f}"
          f"{(pct(p, 99) - pct(d, 99)) * ms:10.3f}")
    print(f"\nSSE relay, one stream of {chunks} chunks")
    print(f"{'direct':10}{rd:12,.0f} chunks/s")
    print(f"{'prefixd':10}{rp:12,.0f} chunks/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--chunks", type=int, default=100_000)
    args = ap.parse_args()
    if args.upstream:
        run_upstream(args.upstream)
    else:
        asyncio.run(bench(args.requests, args.chunks))


if __name__ == "__main__":
    main()
