"""The real proxy in front of a managed backend whose worker is tests/fake_worker.py:
a worker killed mid-stream while requests wait, a crash-looping worker, and shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import psutil
import pytest
from fake_worker import fake_command, gone
from proxy_fixtures import read_until

from prefixd.backends.managed import ManagedBackend
from prefixd.backends.supervision.process import TOKEN_ENV, free_port
from prefixd.backends.supervision.states import ProcState
from prefixd.proxy.server import Server, make_proxy
from prefixd.proxy.settings import Settings

Start = Callable[..., Awaitable[tuple[Server, ManagedBackend]]]


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "fake", "stream": True, "messages": [{"role": "user", "content": "hi"}],
            **extra}


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    servers: list[Server] = []

    async def _start(mode: str = "normal", **backend: Any) -> tuple[Server, ManagedBackend]:
        settings = Settings(_env_file=None, prefix_detect=False, use_system_blas=False,
                            backends=[{"name": "w", "kind": "mlx", "model": "fake-model",
                                       "models": ["fake"], "worker_env": {"FAKE_WORKER_MODE": mode},
                                       **backend}])
        managed = ManagedBackend(settings.backends[0], settings, command=fake_command,
                                 stop_grace_s=2.0, backoff_s=(0.05, 0.2), retry_min_s=3600)
        server = Server(make_proxy(settings, [managed]))
        await server.start("127.0.0.1", 0)
        servers.append(server)
        return server, managed

    yield _start
    for s in servers:
        await s.shutdown(1.0)
    assert psutil.Process().children(recursive=True) == []   # no worker outlives prefixd


async def stalled(backend: ManagedBackend, pid: int) -> None:
    """Until the worker `pid` has received its first request (and stalls in it)."""
    token = psutil.Process(pid).environ()[TOKEN_ENV]
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            async with s.get(backend.status().detail["url"] + "/stats",
                             headers={"Authorization": f"Bearer {token}"}) as r:
                if (await r.json())["requests"] == 1:
                    return
            await asyncio.sleep(0.05)
    raise AssertionError("the worker never got the request")


async def test_kill_9_mid_stream_while_five_wait(start: Start, http: aiohttp.ClientSession) -> None:
    server, backend = await start(max_concurrency=1)       # the others wait in prefixd's queue
    await backend.ensure_ready()
    pid1 = backend.status().detail["pid"]
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"

    first = await http.post(url, json=chat(fake={"chunks": 100, "delay": 0.1}))
    await read_until(first, b"data: {")                       # it is streaming now
    waiting = []
    for _ in range(5):                                        # queued behind it, in order
        r = await http.post(url, json=chat())
        await read_until(r, b": queued position=")
        waiting.append(r)

    os.kill(pid1, signal.SIGKILL)

    # The client being served gets an SSE error event, then the end of the stream.
    rest = (await first.read()).decode()
    events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "upstream_error" and "'w'" in error["message"]

    # The waiting ones are all served, by the restarted worker.
    for r in waiting:
        body = await r.read()
        assert body.rstrip().endswith(b"data: [DONE]"), body
        assert b'"error"' not in body
    st = backend.status()
    assert st.state == "ready" and st.detail["pid"] != pid1 and st.detail["restarts"] == 1
    assert gone(pid1)
    # None lost, none duplicated: the new worker received exactly the five.
    token = psutil.Process(st.detail["pid"]).environ()[TOKEN_ENV]
    async with http.get(st.detail["url"] + "/stats",
                        headers={"Authorization": f"Bearer {token}"}) as r:
        assert (await r.json())["requests"] == 5

    status = await (await http.get(f"http://127.0.0.1:{server.port}/status")).json()
    assert status["backends"][0]["state"] == "ready"
    assert "SIGKILL" in status["backends"][0]["last_error"]


async def test_a_worker_killed_in_its_prefill_answers_after_its_restart(
        start: Start, http: aiohttp.ClientSession) -> None:
    """The only worker of the model dies before a stream's first content (its role chunk
    held back by the proxy): the client gets one whole answer from the restarted worker."""
    server, backend = await start()
    await backend.ensure_ready()
    pid1 = backend.status().detail["pid"]
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    task = asyncio.create_task(http.post(url, json=chat(fake={"stall_pid": pid1})))
    await stalled(backend, pid1)
    os.kill(pid1, signal.SIGKILL)
    r = await task
    body = (await r.read()).decode()
    assert r.status == 200 and '"error"' not in body and body.rstrip().endswith("data: [DONE]")
    # the dead worker's role chunk never reached the client (held back); the whole answer did
    assert '"role"' not in body and "w0" in body and "w4" in body
    st = backend.status()
    assert st.detail["pid"] != pid1 and st.detail["restarts"] == 1


async def test_crash_loop_ends_failed_and_ready_says_why(start: Start,
                                                         http: aiohttp.ClientSession) -> None:
    server, backend = await start("exit", max_restarts=1)
    base = f"http://127.0.0.1:{server.port}"
    async with http.post(base + "/v1/chat/completions", json=chat(stream=False)) as r:
        assert r.status == 503
        message = (await r.json())["error"]["message"]
    assert "cannot load model 'nope'" in message
    await backend.wait_for(ProcState.FAILED, timeout=10)
    async with http.get(base + "/ready") as r:
        assert r.status == 503
        ready = await r.json()
    assert ready["backends"]["w"]["state"] == "failed"
    assert "cannot load model 'nope'" in ready["backends"]["w"]["last_error"]
    assert "gave up after 2 attempts" in ready["backends"]["w"]["last_error"]
    async with http.get(base + "/status") as r:
        status = (await r.json())["backends"][0]
    assert 0 < status["retry_in_s"] <= 60 and status["retry_at"] > 0    # when it tries again
    async with http.post(base + "/v1/chat/completions", json=chat()) as r:
        assert r.status == 503
        assert "failed" in (await r.json())["error"]["message"]


async def test_shutdown_stops_a_worker_that_ignores_sigterm(start: Start) -> None:
    server, backend = await start("ignore_term")
    await backend.ensure_ready()
    pid = backend.status().detail["pid"]
    await server.shutdown(1.0)
    assert gone(pid)
    assert backend.status().state == "shutdown"


async def test_sigterm_to_prefixd_stops_its_real_worker(tiny_model_dir: Callable[[str], Any],
                                                        tmp_path: Any) -> None:
    """`prefixd serve` with a managed backend on a tiny model: SIGTERM ends both processes."""
    port = free_port()
    backends = json.dumps([{"name": "w", "kind": "mlx", "model": str(tiny_model_dir("qwen3")),
                            "models": ["tiny"]}])
    env = {**os.environ, "PREFIXD_BACKENDS": backends, "PREFIXD_USE_SYSTEM_BLAS": "false",
           "PREFIXD_SHUTDOWN_TIMEOUT_S": "5"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixd.proxy.cli", "serve", "--port", str(port), env=env,
        cwd=str(tmp_path), stdin=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    worker = None
    try:
        assert proc.stderr is not None
        while True:                       # prefixd's own log says what it started, and when
            line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
            assert line, "prefixd exited before its worker was ready"
            if match := re.search(r"\[w\] started pid (\d+)", line):
                worker = int(match.group(1))
            if "backend w: starting -> ready" in line:
                break
        assert worker is not None and psutil.Process(worker).ppid() == proc.pid
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert gone(worker)


async def test_bad_model_path_ends_failed_with_reason_in_status_and_503(
        http: aiohttp.ClientSession) -> None:
    """The real worker on a model folder that does not exist: its load-failure exit status
    makes the backend `failed` at once, without the restarts a crash would get."""
    settings = Settings(_env_file=None, prefix_detect=False,
                        backends=[{"name": "bad", "kind": "mlx", "model": "/nonexistent/model",
                                   "models": ["m"], "max_restarts": 5}])
    managed = ManagedBackend(settings.backends[0], settings, backoff_s=(0.05, 0.2),
                             retry_min_s=3600)     # the request below must not retry it
    server = Server(make_proxy(settings, [managed]))
    await server.start("127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.port}"
        await managed.wait_for(ProcState.FAILED, timeout=60)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(base + "/v1/chat/completions", json=body) as r:
            assert r.status == 503
            message = (await r.json())["error"]["message"]
        async with http.get(base + "/status") as r:
            status = (await r.json())["backends"][0]
        assert status["state"] == "failed" and status["restarts"] == 0
        assert "exited with code 1" in status["last_error"]
        for text in (message, status["last_error"]):
            assert "/nonexistent/model" in text
    finally:
        await server.shutdown(1.0)
    assert psutil.Process().children(recursive=True) == []


async def test_a_request_sent_again_after_its_worker_died_keeps_its_place(
        start: Start, http: aiohttp.ClientSession) -> None:
    """Killed in its prefill with five requests queued behind it: the request is sent again
    before them (it had waited its turn), not after them."""
    server, backend = await start(max_concurrency=1)       # the others wait in prefixd's queue
    await backend.ensure_ready()
    pid1 = backend.status().detail["pid"]
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    done: list[int] = []

    async def ask(i: int, **fake: Any) -> None:
        async with http.post(url, json=chat(fake=fake or {"chunks": 3, "delay": 0.02})) as r:
            body = await r.read()
        assert r.status == 200 and b'"error"' not in body and body.rstrip().endswith(
            b"data: [DONE]")
        done.append(i)

    first = asyncio.create_task(ask(0, stall_pid=pid1))
    await stalled(backend, pid1)
    waiting = []
    for i in range(1, 6):
        waiting.append(asyncio.create_task(ask(i)))
        queue = server.proxy.queues["w"]
        for _ in range(200):                     # in this order
            if queue.waiting == i:
                break
            await asyncio.sleep(0.01)
    os.kill(pid1, signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(first, *waiting), 60)
    assert done == [0, 1, 2, 3, 4, 5]
