"""A stand-in for `prefixd worker` at the process boundary: same argv, same /health, an
OpenAI-shaped slow SSE stream — and ways to misbehave, chosen by env FAKE_WORKER_MODE:

  normal       serve (default)
  crash        os._exit(1) in the middle of every stream
  hang         never open the port (a model load that never ends)
  exit         print an error on stderr and exit 3 at once (a failure of unknown kind)
  ignore_term  serve, but ignore SIGTERM

FAKE_WORKER_BROKEN=<path>: while that file exists, the worker cannot "load its model": it
says so on stderr and exits 1, the real worker's load-failure status (delete the file to
fix the model). Like the real worker, with PREFIXD_WORKER_TOKEN set every route but /health
answers 401 unless the request carries `Authorization: Bearer <token>`.

FAKE_WORKER_CRASH_ONCE=<path>: crash in the middle of the first stream only (the file
marks that it happened, so the restarted worker serves). Request header `x-fake-crash: 1`
crashes that request's stream. FAKE_WORKER_CHUNKS / FAKE_WORKER_DELAY shape the stream,
a body field `"fake": {"chunks": N, "delay": s}` one request's (`"stall_pid": P`: the worker
with that PID sends the role chunk, then stalls, as in a long prefill). GET /stats counts requests.
GET /v1/cache answers like the real worker's: `bytes_budget` is PREFIXD_CACHE_BYTES (what the
proxy gave it), nothing used; with FAKE_WORKER_RSS=<bytes> it also reports that much memory
(the real worker's "memory" object), so the proxy's pool measures its footprint. Started as a
group (PREFIXD_GROUP_HOSTS, a backend with `hosts`), it reports one rank per host as the real
leader does, each holding FAKE_WORKER_RSS, with a cache of that budget (it starts no ranks).
Like the real worker, it exits when PREFIXD_PARENT_PID is no longer its parent.
"""
# ruff: noqa: E402  (the hang notice is printed before the slower imports)

from __future__ import annotations

import os
import sys

MODE = os.environ.get("FAKE_WORKER_MODE", "normal")
if __name__ == "__main__" and MODE == "hang":
    # First thing: a test's start-up deadline may be shorter than importing aiohttp.
    print("fake worker: loading forever", file=sys.stderr, flush=True)

import argparse
import asyncio
import contextlib
import hmac
import json
import signal
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

TOKEN = os.environ.get("PREFIXD_WORKER_TOKEN")
STATS = {"requests": 0}     # chat requests received, for "none lost, none duplicated"


def fake_command(port: int) -> list[str]:
    """For tests: the argv that runs this script as a managed backend's worker."""
    return [sys.executable, __file__, "--model", "fake", "--host", "127.0.0.1",
            "--port", str(port)]


def gone(pid: int) -> bool:
    """For tests: the process has exited (a zombie nobody reaped yet counts as gone)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _chunk(i: int, text: str) -> bytes:
    data = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": "fake", "choices": [{"index": 0, "delta": {"content": text},
                                          "finish_reason": None}]}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def _should_crash(request: web.Request) -> bool:
    if MODE == "crash" or request.headers.get("x-fake-crash") == "1":
        return True
    flag = os.environ.get("FAKE_WORKER_CRASH_ONCE")
    if flag and not os.path.exists(flag):
        with open(flag, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


@web.middleware
async def auth(request: web.Request,
               handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
               ) -> web.StreamResponse:
    got = request.headers.get("Authorization", "").encode()
    if TOKEN and request.path != "/health" and not hmac.compare_digest(
            got, f"Bearer {TOKEN}".encode()):
        return web.json_response({"error": {"message": "this worker needs its token",
                                             "type": "invalid_request_error", "param": None,
                                             "code": "invalid_api_key"}}, status=401)
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "pid": os.getpid()})


async def stats(request: web.Request) -> web.Response:
    return web.json_response({**STATS, "pid": os.getpid()})


async def tokenize(request: web.Request) -> web.Response:
    return web.json_response({"tokens": [1, 2, 3]})


async def cache(request: web.Request) -> web.Response:
    body: dict = {"bytes_budget": int(os.environ.get("PREFIXD_CACHE_BYTES", "0")),
                  "bytes_used": 0, "entries": [], "checkpoints": 0}
    if rss := os.environ.get("FAKE_WORKER_RSS"):
        body["memory"] = {"rss_bytes": int(rss), "rss_source": "fake"}
    if hosts := os.environ.get("PREFIXD_GROUP_HOSTS"):
        ranks = [{"rank": r, "host": h, "pid": os.getpid(), "memory": body.get("memory")}
                 for r, h in enumerate(json.loads(hosts))]
        for follower in ranks[1:]:          # with their heartbeats: their caches' bytes
            follower["cache_bytes"] = 0
        body["group"] = {"hosts": json.loads(hosts), "parallel": "pipeline", "ranks": ranks}
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text="fake_worker_up 1\n")


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    STATS["requests"] += 1
    shape = body.get("fake") or {}
    n = int(shape.get("chunks", os.environ.get("FAKE_WORKER_CHUNKS", "5")))
    delay = float(shape.get("delay", os.environ.get("FAKE_WORKER_DELAY", "0.02")))
    words = [f"w{i} " for i in range(n)]
    if not body.get("stream"):
        return web.json_response({
            "id": "chatcmpl-fake", "object": "chat.completion", "model": "fake",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n,
                      "pid": os.getpid()}})
    crash = _should_crash(request)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if shape.get("stall_pid") == os.getpid():     # a long prefill: the role, then nothing
        await resp.write(b'data: {"id": "chatcmpl-fake", "object": "chat.completion.chunk", '
                         b'"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n')
        await asyncio.sleep(3600)
    for i, w in enumerate(words):
        if crash and i == 2:
            print("fake worker: crashing mid-stream", file=sys.stderr, flush=True)
            os._exit(1)
        await resp.write(_chunk(i, w))
        await asyncio.sleep(delay)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(0.1)
    with contextlib.suppress(OSError):   # our stderr pipe died with the parent
        print("fake worker: parent gone, exiting", file=sys.stderr, flush=True)
    os._exit(0)


async def main(port: int) -> None:
    print(f"fake worker {os.getpid()} mode={MODE} port={port}", flush=True)
    parent = os.environ.get("PREFIXD_PARENT_PID")
    watcher = asyncio.create_task(watch_parent(int(parent))) if parent else None
    if MODE == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if MODE == "hang":
        await asyncio.Event().wait()
    app = web.Application(middlewares=[auth])
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/cache", cache)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    if MODE != "ignore_term":
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await runner.cleanup()
    if watcher:
        watcher.cancel()


if __name__ == "__main__":
    if MODE == "exit":
        print("fake worker: cannot load model 'nope': no such file", file=sys.stderr, flush=True)
        sys.exit(3)
    broken = os.environ.get("FAKE_WORKER_BROKEN")
    if broken and os.path.exists(broken):
        print(f"fake worker: cannot load model: {broken} is broken", file=sys.stderr, flush=True)
        sys.exit(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=int(os.environ.get("FAKE_WORKER_PORT", "0")))
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--model", default="fake")
    asyncio.run(main(ap.parse_args().port))
