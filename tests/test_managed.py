"""The managed `mlx` backend on real child processes (tests/fake_worker.py as the worker):
start-up, deadlines, early exits, load failures, crashes mid-stream, the restart policy,
retries of a failed backend, the worker token, idle unload, stop, orphans."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import psutil
import pytest
from fake_worker import fake_command, gone

from prefixd.backends.base import Backend, BackendError, BackendUnavailable, UpstreamRequest
from prefixd.backends.managed import ManagedBackend
from prefixd.backends.supervision.process import GROUP_FIELDS, TOKEN_ENV, worker_command, worker_env
from prefixd.backends.supervision.states import ProcState
from prefixd.metrics import REGISTRY
from prefixd.proxy.settings import BackendConfig, Settings

FAKE = Path(__file__).with_name("fake_worker.py")
SETTINGS = Settings(_env_file=None, use_system_blas=False)
Make = Callable[..., ManagedBackend]


def chat(stream: bool = True, headers: dict[str, str] | None = None) -> UpstreamRequest:
    body = {"model": "fake", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    return UpstreamRequest(path="/v1/chat/completions", body=json.dumps(body).encode(),
                           stream=stream, request_id="r1", headers=headers or {})


async def read_all(b: ManagedBackend, req: UpstreamRequest) -> bytes:
    async with b.forward(req) as resp:
        assert resp.status == 200
        return b"".join([c async for c in resp.chunks])


def metric(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def answering_pid(b: ManagedBackend) -> int:
    """Which worker process answered a (non-streamed) request."""
    return json.loads(await read_all(b, chat(stream=False)))["usage"]["pid"]


def kill_and_wait(pid: int) -> None:
    """SIGKILL a worker and wait for its death without yielding to the event loop, so the
    supervisor has not noticed it yet when the test goes on."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while not gone(pid):
        assert time.monotonic() < deadline, f"pid {pid} did not die"


def token_of(pid: int) -> str:
    """The token a worker process was started with (read from its environment)."""
    return psutil.Process(pid).environ()[TOKEN_ENV]


@pytest.fixture
async def make() -> AsyncIterator[Make]:
    made: list[ManagedBackend] = []

    def _make(mode: str = "normal", *, grace: float = 2.0, env: dict[str, str] | None = None,
              backoff: tuple[float, float] = (0.02, 0.1), retry_min: float = 3600.0,
              **cfg: object) -> ManagedBackend:
        config = BackendConfig(name=f"fake{len(made)}", kind="mlx", model="fake-model",
                               worker_env={"FAKE_WORKER_MODE": mode, **(env or {})}, **cfg)
        b = ManagedBackend(config, SETTINGS, command=fake_command, stop_grace_s=grace,
                           backoff_s=backoff, retry_min_s=retry_min)
        made.append(b)
        return b

    yield _make
    for b in made:
        await b.stop()
    # No orphans: every worker this test started is reaped once its backend stopped.
    assert psutil.Process().children(recursive=True) == []


async def test_start_ready_answer_stop(make: Make, caplog: pytest.LogCaptureFixture) -> None:
    b = make()
    assert isinstance(b, Backend)
    assert b.status().state == "stopped"
    with caplog.at_level("INFO", logger="prefixd.worker"):
        await b.ensure_ready()
    st = b.status()
    assert (st.state, st.up, st.kind, st.models) == ("ready", True, "mlx", ["fake-model"])
    pid = st.detail["pid"]
    assert metric("prefixd_backend_state", backend=b.name, state="ready") == 1
    assert metric("prefixd_backend_state", backend=b.name, state="starting") == 0
    assert metric("prefixd_backend_up", backend=b.name) == 1
    # Worker output reaches our log line by line, tagged with the backend name.
    assert any(r.getMessage().startswith(f"[{b.name}] fake worker {pid}") for r in caplog.records)

    body = await read_all(b, chat(stream=True))
    assert body.count(b"data: ") == 6 and body.endswith(b"data: [DONE]\n\n")
    answer = json.loads(await read_all(b, chat(stream=False)))
    assert answer["usage"]["pid"] == pid

    await b.stop()
    assert b.status().state == "shutdown" and not b.status().up
    assert gone(pid)
    assert metric("prefixd_backend_state", backend=b.name, state="shutdown") == 1
    with pytest.raises(BackendUnavailable, match="shut down"):
        await b.ensure_ready()


async def test_concurrent_callers_share_one_start(make: Make) -> None:
    b = make()
    await asyncio.gather(*(b.ensure_ready() for _ in range(5)))
    assert b.status().detail["restarts"] == 0
    assert len(psutil.Process().children()) == 1


async def test_hang_at_startup_hits_the_deadline(make: Make) -> None:
    b = make("hang", startup_timeout_s=1.0, max_restarts=0)
    with pytest.raises(BackendUnavailable, match=r"timed out after 1s.*loading forever"):
        await b.ensure_ready()
    assert await b.wait_for(ProcState.FAILED, timeout=5) is ProcState.FAILED
    assert psutil.Process().children() == []   # the hung child was killed
    with pytest.raises(BackendUnavailable, match=r"failed: .*timed out.*next attempt in"):
        await b.ensure_ready()


async def test_exit_at_once_reports_stderr_and_ends_failed(make: Make) -> None:
    b = make("exit", max_restarts=2)
    restarts0 = metric("prefixd_backend_restarts_total", backend=b.name) or 0.0
    messages = []
    while b.status().state != "failed":       # each call waits for one attempt's outcome
        with pytest.raises(BackendUnavailable) as exc:
            await b.ensure_ready()
        messages.append(str(exc.value))
        assert len(messages) <= 4
    assert "exited with code 3" in messages[0]
    assert all("cannot load model 'nope'" in m for m in messages)
    st = b.status()
    assert "gave up after 3 attempts" in (st.last_error or "")
    assert st.detail["restarts"] == 2
    assert metric("prefixd_backend_restarts_total", backend=b.name) == restarts0 + 2
    assert metric("prefixd_backend_state", backend=b.name, state="failed") == 1


async def test_crash_mid_stream_then_restart_serves_waiters(make: Make) -> None:
    b = make()
    await b.ensure_ready()
    pid1 = b.status().detail["pid"]
    seen: list[bytes] = []
    with pytest.raises(BackendError):
        async with b.forward(chat(headers={"x-fake-crash": "1"})) as resp:
            async for chunk in resp.chunks:
                seen.append(chunk)
    assert seen, "the stream had started before the crash"

    # What the proxy's queue does next: the waiting requests call ensure_ready(), in order.
    async def next_request() -> bytes:
        await b.ensure_ready()
        return await read_all(b, chat())

    bodies = await asyncio.gather(*(next_request() for _ in range(3)))
    assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies)
    st = b.status()
    assert st.state == "ready" and st.detail["pid"] != pid1 and st.detail["restarts"] == 1
    assert "killed" in (st.last_error or "") or "code 1" in (st.last_error or "")
    assert gone(pid1)


async def test_request_racing_a_dead_worker_is_retried_not_lost(make: Make) -> None:
    b = make()
    await b.ensure_ready()
    pid = b.status().detail["pid"]
    kill_and_wait(pid)
    body = await read_all(b, chat())          # refused at connect → restart → sent once
    assert body.endswith(b"data: [DONE]\n\n")
    assert b.status().detail["pid"] != pid


async def test_worker_dying_with_the_request_unanswered_gets_it_sent_again(make: Make) -> None:
    """The ~5 ms window of an idle worker's death: the kernel accepted our connection for
    a worker that then died without reading it, so it is reset, not refused. Widened here
    by freezing the worker (SIGSTOP) until the connection is up, then killing it."""
    b = make(health_interval_s=3600)         # no health probe connects meanwhile
    await b.ensure_ready()
    for _ in range(3):
        pid, port = b.status().detail["pid"], int(b.status().detail["url"].rsplit(":", 1)[1])
        assert await answering_pid(b) == pid
        os.kill(pid, signal.SIGSTOP)
        request = asyncio.create_task(answering_pid(b))
        async with asyncio.timeout(10):      # our connection sits in the frozen one's backlog
            while not any(c.raddr and c.raddr.port == port and c.status == "ESTABLISHED"
                          for c in psutil.Process().net_connections("tcp")):
                await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)         # the kernel resets the unaccepted connection
        assert await asyncio.wait_for(request, 20) not in (pid, None)   # served, once, anew
    assert b.status().state == "ready" and b.status().detail["restarts"] == 3


async def test_crashes_after_ready_are_restarted_not_counted_as_failed_starts(
        make: Make) -> None:
    """4 SIGKILLs in a row of a worker that had become ready: each is restarted (with
    backoff), however low max_restarts is; none is a failed start."""
    b = make(max_restarts=1)
    await b.ensure_ready()
    pids = [b.status().detail["pid"]]
    for _ in range(4):
        kill_and_wait(pids[-1])
        pids.append(await answering_pid(b))
    assert len(set(pids)) == 5 and all(gone(p) for p in pids[:-1])
    st = b.status()
    assert st.state == "ready" and st.detail["restarts"] == 4
    assert st.detail["consecutive_failures"] == 0 and st.detail["retry_in_s"] is None


async def test_load_failure_fails_at_once_then_a_request_retries_it(make: Make,
                                                                     tmp_path: Path) -> None:
    """Exit status 1 while starting (the worker cannot load its model) is not retried like a
    crash: `failed` at once, the worker's stderr in the reason. Once the model is fixed, a
    request for the backend makes it try again."""
    broken = tmp_path / "broken"
    broken.touch()
    b = make(env={"FAKE_WORKER_BROKEN": str(broken)}, max_restarts=5, retry_min=0)
    with pytest.raises(BackendUnavailable, match=r"could not start: .*exited with code 1.*"
                       r"is broken"):
        await b.ensure_ready()
    assert await b.wait_for(ProcState.FAILED, timeout=5) is ProcState.FAILED
    st = b.status()
    assert st.detail["restarts"] == 0 and st.detail["consecutive_failures"] == 1
    assert f"{broken} is broken" in (st.last_error or "")
    assert st.detail["stderr_tail"][-1].endswith("is broken")
    assert 0 < st.detail["retry_in_s"] <= 60 and st.detail["retry_at"] > time.time()

    broken.unlink()                           # the model folder is fixed
    await b.ensure_ready()                    # the request's retry starts it
    st = b.status()
    assert st.state == "ready" and st.detail["restarts"] == 1
    assert st.detail["retry_at"] is None and st.detail["retry_in_s"] is None
    assert await answering_pid(b) == st.detail["pid"]


async def test_failed_backend_retries_on_its_schedule(make: Make, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.touch()
    b = make(env={"FAKE_WORKER_BROKEN": str(broken)}, retry_failed_s=0.2)
    with pytest.raises(BackendUnavailable, match="could not start"):
        await b.ensure_ready()
    await b.wait_for(ProcState.FAILED, timeout=5)
    broken.unlink()
    # No request: the slow schedule alone brings it back.
    assert await b.wait_for(ProcState.READY, timeout=10) is ProcState.READY
    assert b.status().detail["restarts"] >= 1


async def test_a_request_does_not_retry_a_failed_backend_too_often(make: Make) -> None:
    b = make("exit", max_restarts=0, retry_failed_s=3600, retry_min=3600)
    with pytest.raises(BackendUnavailable, match="could not start"):
        await b.ensure_ready()
    await b.wait_for(ProcState.FAILED, timeout=5)
    for _ in range(3):                        # the last attempt is too recent: no new one
        with pytest.raises(BackendUnavailable, match=r"failed: .*next attempt in \d+s"):
            await b.ensure_ready()
    assert b.status().detail["restarts"] == 0 and b.status().state == "failed"


async def test_worker_needs_its_token_and_the_supervisor_sends_it(make: Make) -> None:
    b = make()
    await b.ensure_ready()
    st = b.status()
    pid, url = st.detail["pid"], st.detail["url"]
    token = token_of(pid)
    assert len(token) >= 32
    async with aiohttp.ClientSession() as http:   # another local process, without the token
        async with http.post(url + "/v1/chat/completions", data=chat().body) as r:
            assert r.status == 401
        async with http.get(url + "/metrics") as r:
            assert r.status == 401
        async with http.get(url + "/health") as r:
            assert r.status == 200
    # Everything the supervisor sends carries it: requests, /tokenize, /metrics.
    assert await answering_pid(b) == pid
    assert await b.tokenize({"messages": []}) == [1, 2, 3]
    assert await b.metrics_text() == "fake_worker_up 1\n"
    assert token not in json.dumps(b.status().detail)     # /status shows pid and URL only
    kill_and_wait(pid)
    new_pid = await answering_pid(b)
    assert token_of(new_pid) != token                      # a fresh token per start


async def test_ignoring_sigterm_still_stops_within_grace(make: Make) -> None:
    b = make("ignore_term", grace=1.0)
    await b.ensure_ready()
    pid = b.status().detail["pid"]
    t0 = time.monotonic()
    await b.stop()
    elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 2.0
    assert gone(pid)


async def test_idle_unload_then_start_again(make: Make) -> None:
    b = make(idle_unload_s=0.3)
    await b.ensure_ready()
    pid1 = b.status().detail["pid"]
    await read_all(b, chat())
    assert await b.wait_for(ProcState.STOPPED, timeout=5) is ProcState.STOPPED
    assert gone(pid1) and b.status().detail["pid"] is None
    await b.ensure_ready()
    assert b.status().detail["pid"] not in (None, pid1)


async def test_real_worker_on_a_tiny_model(tiny_model_dir: Callable[[str], Path]) -> None:
    """The default command: `python -m prefixd.backends.mlx` serving a tiny random model."""
    cfg = BackendConfig(name="real", kind="mlx", model=str(tiny_model_dir("qwen3")),
                        models=["tiny"], worker_env={"PREFIXD_MAX_TOKENS_DEFAULT": "4"})
    b = ManagedBackend(cfg, SETTINGS)
    try:
        await b.ensure_ready()
        pid = b.status().detail["pid"]
        body = json.dumps({"model": "tiny", "stream": True,
                           "messages": [{"role": "user", "content": "hello"}]}).encode()
        req = UpstreamRequest(path="/v1/chat/completions", body=body, stream=True,
                              request_id="real")
        out = await read_all(b, req)
        assert b'"model": "tiny"' in out and out.endswith(b"data: [DONE]\n\n")
    finally:
        await b.stop()
    assert gone(pid) and psutil.Process().children() == []


def test_worker_command_and_env() -> None:
    assert worker_command("some/model", 4321) == [
        sys.executable, "-m", "prefixd.backends.mlx", "--model", "some/model",
        "--host", "127.0.0.1", "--port", "4321"]
    assert worker_command("m", 1, "alias")[-2:] == ["--served-name", "alias"]
    cfg = BackendConfig(name="w", kind="mlx", model="m", cache_bytes=12345,
                        worker_env={"PREFIXD_PREFILL_CHUNK": "64", "X": "1"})
    env = worker_env(cfg, Settings(_env_file=None, use_system_blas=False, checkpoint_tail=7),
                     base={"PATH": "/bin", "PREFIXD_PORT": "abc", "PREFIXD_BACKENDS": "[]"})
    assert env["PATH"] == "/bin"
    assert "PREFIXD_PORT" not in env and "PREFIXD_BACKENDS" not in env   # the proxy's own
    assert env["PREFIXD_PARENT_PID"] == str(os.getpid())
    assert env["PREFIXD_CACHE_BYTES"] == "12345"          # the backend's budget wins
    shared = cfg.model_copy(update={"cache_bytes": None})
    assert worker_env(cfg, SETTINGS, cache_bytes=999)["PREFIXD_CACHE_BYTES"] == "12345"
    assert worker_env(shared, SETTINGS, cache_bytes=999)["PREFIXD_CACHE_BYTES"] == "999"
    assert env["PREFIXD_CHECKPOINT_TAIL"] == "7"          # settings handed over explicitly
    assert env["PREFIXD_PREFILL_CHUNK"] == "64" and env["X"] == "1"
    assert env["PREFIXD_MAX_ACTIVE"] == "64"   # the default: every request it can rank
    for n in (1, 3):                                        # the proxy sends n at once
        one = cfg.model_copy(update={"max_concurrency": n})
        assert worker_env(one, SETTINGS)["PREFIXD_MAX_ACTIVE"] == str(n)
    assert BackendConfig(name="o", url="http://127.0.0.1:1", models=["m"]).concurrency == 1
    assert "LD_PRELOAD" not in env
    assert TOKEN_ENV not in env                           # no token given: none set
    cfg = cfg.model_copy(update={"worker_env": {TOKEN_ENV: "from-config"}})
    env = worker_env(cfg, SETTINGS, base={TOKEN_ENV: "inherited"}, token="t0k")
    assert env[TOKEN_ENV] == "t0k"                        # only the supervisor's own
    # Every worker setting reaches the worker, including ones added later (but the group:
    # the backend's own, tests/test_group_hosts.py).
    worker_fields = [name for name, f in Settings.model_fields.items()
                     if (f.description or "").startswith("Worker")]
    assert worker_fields and all(f"PREFIXD_{n.upper()}" in env for n in worker_fields
                                 if getattr(SETTINGS, n) is not None and n not in GROUP_FIELDS)
    assert not GROUP_FIELDS & {k.removeprefix("PREFIXD_").lower() for k in env}


def test_proxy_side_never_imports_mlx() -> None:
    code = ("import sys; from prefixd.backends.managed import ManagedBackend; "
            "from prefixd.backends.supervision.process import worker_env; "
            "from prefixd.proxy.settings import BackendConfig, Settings; "
            "worker_env(BackendConfig(name='w', kind='mlx', model='m'), "
            "Settings(_env_file=None, use_system_blas=True)); "
            "assert 'mlx' not in sys.modules, sorted(m for m in sys.modules if 'mlx' in m)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


_PARENT = textwrap.dedent("""
    import asyncio, sys
    from prefixd.backends.managed import ManagedBackend
    from prefixd.proxy.settings import BackendConfig, Settings
    async def main():
        cfg = BackendConfig(name="orphan", kind="mlx", model="m")
        b = ManagedBackend(cfg, Settings(_env_file=None, use_system_blas=False),
                           command=lambda port: [sys.executable, sys.argv[1], "--port", str(port)])
        await b.ensure_ready()
        print(b.status().detail["pid"], flush=True)
        await asyncio.Event().wait()
    asyncio.run(main())
""")


def test_worker_exits_when_prefixd_is_killed() -> None:
    with subprocess.Popen([sys.executable, "-c", _PARENT, str(FAKE)], stdout=subprocess.PIPE,
                          text=True) as parent:
        try:
            assert parent.stdout is not None
            worker = psutil.Process(int(parent.stdout.readline()))
            assert worker.ppid() == parent.pid
        finally:
            parent.kill()            # SIGKILL: prefixd gets no chance to stop its worker
    _, alive = psutil.wait_procs([worker], timeout=5)
    assert alive == [] or all(p.status() == psutil.STATUS_ZOMBIE for p in alive)
