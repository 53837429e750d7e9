"""The `prefixd` command as a user runs it: bad settings and a port in use exit 2 with one
line, `config` redacts secrets, SIGTERM drains in-flight requests and answers queued ones 503,
SIGINT works while a worker starts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys

import aiohttp
import psutil
import pytest

from prefixd.backends.openai import OpenAIBackend
from prefixd.proxy.cli import main
from prefixd.proxy.settings import BackendConfig


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    env.update(extra)
    return env


async def run_cli(*args: str, env: dict[str, str], cwd: str | None = None
                  ) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixd.proxy.cli", *args, env=env, cwd=cwd,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:      # it hung: don't leave it behind
            proc.kill()
            await proc.wait()
    return proc.returncode or 0, out.decode(), err.decode()


async def test_bad_setting_exits_2_naming_the_variable(tmp_path):
    code, _, err = await run_cli("serve", env=_env(PREFIXD_PORT="eighty"), cwd=str(tmp_path))
    assert code == 2
    assert "PREFIXD_PORT" in err and "Traceback" not in err
    bad = json.dumps([{"name": "x", "kind": "openai", "models": ["m"]}])
    code, _, err = await run_cli("serve", env=_env(PREFIXD_BACKENDS=bad), cwd=str(tmp_path))
    assert code == 2 and "PREFIXD_BACKENDS" in err and "needs 'url'" in err


async def test_env_file_and_config_redacts_secrets(tmp_path):
    backends = [{"name": "a", "url": "http://bob:urlsecret@127.0.0.1:1/v1", "models": ["m"],
                 "api_key": "upsecret"},
                {"name": "b", "url": "https://tokensecret@example.com", "models": ["n"]},
                {"name": "w", "kind": "mlx", "model": "/models/x",
                 "worker_env": {"HF_TOKEN": "hfsecret", "PREFIXD_PREFILL_CHUNK": "64"}}]
    env_file = tmp_path / "p.env"
    env_file.write_text(f"PREFIXD_API_KEY=topsecret\nPREFIXD_PORT=9123\n"
                        f"PREFIXD_BACKENDS={json.dumps(backends)}\n")
    code, out, _ = await run_cli("config", "--env-file", str(env_file), env=_env())
    assert code == 0
    cfg = json.loads(out)
    assert cfg["port"] == 9123 and [b["name"] for b in cfg["backends"]] == ["a", "b", "w"]
    for secret in ("topsecret", "upsecret", "urlsecret", "tokensecret", "hfsecret"):
        assert secret not in out
    a, b, w = cfg["backends"]
    assert cfg["api_key"] == a["api_key"] == "***"
    assert a["url"] == "http://bob:***@127.0.0.1:1/v1" and b["url"] == "https://***@example.com"
    assert w["worker_env"] == {"HF_TOKEN": "***", "PREFIXD_PREFILL_CHUNK": "***"}
    assert main(["config", "--env-file", str(tmp_path / "missing.env")]) == 2


async def test_config_shows_the_default_backend(tmp_path):
    code, out, _ = await run_cli("config", env=_env(PREFIXD_DEFAULT_MODEL="some-model"),
                                 cwd=str(tmp_path))
    assert code == 0
    assert [(b["name"], b["kind"], b["model"]) for b in json.loads(out)["backends"]] == [
        ("default", "mlx", "some-model")]


def test_openai_status_redacts_the_url_password():
    backend = OpenAIBackend(BackendConfig(name="a", url="http://bob:urlsecret@127.0.0.1:1/v1",
                                          models=["m"]))
    assert backend.status().detail["url"] == "http://bob:***@127.0.0.1:1"


@pytest.mark.parametrize("backends", [
    None,                                                      # the default mlx backend
    [{"name": "up", "url": "http://127.0.0.1:1", "models": ["m"]}]])
async def test_port_in_use_exits_2_with_one_line_before_any_worker(tmp_path, backends):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = _env(PREFIXD_DEFAULT_MODEL=str(tmp_path / "no-model"))
        if backends is not None:
            env["PREFIXD_BACKENDS"] = json.dumps(backends)
        code, out, err = await run_cli("serve", "--port", str(port), env=env, cwd=str(tmp_path))
    assert code == 2
    assert err == f"prefixd: cannot listen on 127.0.0.1:{port}: address already in use\n"
    assert out == ""                     # nothing else: no worker started, no traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_sigterm_drains_in_flight_and_503s_queued(upstream, tmp_path):
    port = _free_port()
    backends = json.dumps([{"name": "up", "url": upstream.url, "models": ["fake"]}])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixd.proxy.cli", "serve", "--port", str(port),
        env=_env(PREFIXD_BACKENDS=backends, PREFIXD_SHUTDOWN_TIMEOUT_S="10"), cwd=str(tmp_path),
        stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stderr is not None
        while b"listening" not in await asyncio.wait_for(proc.stderr.readline(), 30):
            pass
        base = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with aiohttp.ClientSession() as http:
            def body(c: str, **kw) -> dict:
                return {"messages": [{"role": "user", "content": c}], **kw}

            in_flight = asyncio.create_task(http.post(base, json=body("a", fake={"hold": True})))
            await upstream.wait_received(1)
            queued = await http.post(base, json=body("b", stream=True))
            assert b"queued position=1" in await queued.content.readuntil(b"\n\n")
            proc.send_signal(signal.SIGTERM)
            rest = await queued.read()              # the queued one is answered 503-style
            assert b"shutting down" in rest and b"[DONE]" in rest
            upstream.release.set()                  # the in-flight one finishes normally
            r = await in_flight
            assert r.status == 200 and (await r.json())["choices"]
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert [b["messages"][0]["content"] for b in upstream.received] == ["a"]


async def test_unparsable_or_duplicate_backends_exit_2(tmp_path):
    for value, words in (("not json", "not valid JSON"),
                         ('[{"name":"x",}]', "not valid JSON"),
                         (json.dumps([{"name": "a", "url": "http://127.0.0.1:1", "models": ["m"]}]
                                     * 2), "unique")):
        code, _, err = await run_cli("config", env=_env(PREFIXD_BACKENDS=value),
                                     cwd=str(tmp_path))
        assert code == 2 and "PREFIXD_BACKENDS" in err and words in err
        assert "Traceback" not in err


async def test_serve_started_by_a_tool_exits_when_the_tool_is_killed(upstream, tmp_path):
    """`prefixd demo` names itself in PREFIXD_PARENT_PID: a killed demo leaves no daemon."""
    port = _free_port()
    backends = json.dumps([{"name": "up", "url": upstream.url, "models": ["fake"]}])
    tool = (f"import os, subprocess, sys\n"
            f"env = dict(os.environ, PREFIXD_PARENT_PID=str(os.getpid()))\n"
            f"p = subprocess.Popen([sys.executable, '-m', 'prefixd.proxy.cli', 'serve', "
            f"'--port', '{port}'], env=env)\n"
            f"print(p.pid, flush=True)\n"
            f"p.wait()\n")
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", tool, env=_env(PREFIXD_BACKENDS=backends), cwd=str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert parent.stdout is not None
    child = int(await asyncio.wait_for(parent.stdout.readline(), 30))
    async with aiohttp.ClientSession() as http:
        async with asyncio.timeout(30):
            while True:                          # wait until the daemon serves
                try:
                    async with http.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.1)
    parent.kill()
    await parent.wait()
    async with asyncio.timeout(15):
        while True:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            await asyncio.sleep(0.1)


async def test_sigint_while_the_worker_starts_stops_both(tmp_path):
    """Signals work during start-up: SIGINT as soon as the worker is spawned ends prefixd
    (status 0) and its worker."""
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixd.proxy.cli", "serve", "--port", str(port),
        env=_env(PREFIXD_DEFAULT_MODEL=str(tmp_path / "no-model"),
                 PREFIXD_USE_SYSTEM_BLAS="false"),
        cwd=str(tmp_path), stdin=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    worker = None
    try:
        assert proc.stderr is not None
        while worker is None:
            line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
            assert line, "prefixd exited before starting its worker"
            if "] started pid " in line:
                worker = int(line.split("] started pid ")[1].split(":")[0])
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert worker is not None
    _, alive = psutil.wait_procs([psutil.Process(worker)] if psutil.pid_exists(worker) else [],
                                 timeout=10)
    assert all(p.status() == psutil.STATUS_ZOMBIE for p in alive)


@pytest.mark.parametrize("aliases", [{"claude-*": "nope"}, {"*": "*"},
                                     {"gpt-*": "m", "claude-*haiku*": "small"}])
async def test_an_alias_to_a_model_no_backend_serves_exits_2_naming_it(tmp_path, aliases):
    backends = json.dumps([{"name": "up", "url": "http://127.0.0.1:1", "models": ["m"]}])
    env = _env(PREFIXD_BACKENDS=backends, PREFIXD_MODEL_ALIASES=json.dumps(aliases))
    code, out, err = await run_cli("serve", "--port", str(_free_port()), env=env,
                                   cwd=str(tmp_path))
    bad = [(p, t) for p, t in aliases.items() if t != "m"]
    assert code == 2 and out == "" and "Traceback" not in err
    assert all(repr(p) in err and repr(t) in err for p, t in bad), err
    assert "'gpt-*'" not in err                   # the good one is not named
