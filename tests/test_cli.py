"""The `prefixd` command as a user runs it: bad settings exit 2 naming the variable,
`config` redacts secrets, SIGTERM drains in-flight requests and answers queued ones 503."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys

import aiohttp

from prefixd.proxy.cli import main


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    env.update(extra)
    return env


async def run_cli(*args: str, env: dict[str, str], cwd: str | None = None
                  ) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixd.proxy.cli", *args, env=env, cwd=cwd,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_bad_setting_exits_2_naming_the_variable(tmp_path):
    code, _, err = await run_cli("serve", env=_env(PREFIXD_PORT="eighty"), cwd=str(tmp_path))
    assert code == 2
    assert "PREFIXD_PORT" in err and "Traceback" not in err
    bad = json.dumps([{"name": "x", "kind": "openai", "models": ["m"]}])
    code, _, err = await run_cli("serve", env=_env(PREFIXD_BACKENDS=bad), cwd=str(tmp_path))
    assert code == 2 and "PREFIXD_BACKENDS" in err and "needs 'url'" in err


async def test_env_file_and_config_redacts_secrets(tmp_path):
    env_file = tmp_path / "p.env"
    env_file.write_text('PREFIXD_API_KEY=topsecret\nPREFIXD_PORT=9123\nPREFIXD_BACKENDS=[{"name":'
                        '"a","url":"http://127.0.0.1:1","models":["m"],"api_key":"upsecret"}]\n')
    code, out, _ = await run_cli("config", "--env-file", str(env_file), env=_env())
    assert code == 0
    cfg = json.loads(out)
    assert cfg["port"] == 9123 and cfg["backends"][0]["name"] == "a"
    assert "topsecret" not in out and "upsecret" not in out
    assert main(["config", "--env-file", str(tmp_path / "missing.env")]) == 2


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
