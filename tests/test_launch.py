"""`prefixd launch` (issue 27 item 4): each client started against a running prefixd with its
model, key, base URL and window on its command line and in its environment, its vendor's
traffic switched off, nothing written into the user's own configuration; `--print` for a
shell profile. The clients here are stand-ins on PATH that record how they were started (the
real Claude Code and Codex runs are tests/test_real_clients.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from prefixd.backends.registry import build_backends
from prefixd.backends.supervision.process import free_port
from prefixd.proxy.launch import RECIPES, Target
from prefixd.proxy.server import Server, make_proxy
from prefixd.proxy.settings import Settings

RECORDER = """#!{python}
import json, os, sys
with open(os.environ["LAUNCH_RECORD"], "w") as f:
    json.dump({{"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd()}}, f)
"""
REPO = Path(__file__).resolve().parent.parent


async def launch(*args: str, home: Path, bindir: Path | None = None,
                 path: str | None = None, argv0: list[str] | None = None,
                 extra_env: dict[str, str] | None = None) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")
           or k == "PREFIXD_VENV"}
    env.update(HOME=str(home), LAUNCH_RECORD=str(home / "record.json"), **(extra_env or {}))
    if bindir is not None:
        env["PATH"] = f"{bindir}:{env.get('PATH', '')}"
    if path is not None:
        env["PATH"] = path
    proc = await asyncio.create_subprocess_exec(
        *(argv0 or [sys.executable, "-m", "prefixd.proxy.cli"]), "launch", *args, env=env,
        cwd=home, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode or 0, out.decode(), err.decode()


def stand_ins(tmp_path: Path) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in RECIPES:
        exe = bindir / name
        exe.write_text(RECORDER.format(python=sys.executable))
        exe.chmod(0o755)
    return bindir


def files_under(home: Path) -> list[str]:
    return sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file())


@pytest.mark.parametrize("client", sorted(RECIPES))
@pytest.mark.parametrize("window", [None, 16384])
async def test_each_client_is_started_configured_and_nothing_is_written(
        client, window, upstream, start_proxy, tmp_path):
    proxy = await start_proxy(upstream.url, api_key="sk-team",
                              backend={"context_window": window} if window else None)
    home = tmp_path / "home"
    home.mkdir()
    url = f"http://127.0.0.1:{proxy.port}"
    # a real Anthropic key in the caller's environment never reaches the client (nor prefixd)
    code, _, err = await launch(client, "--url", url, "--api-key", "sk-team", "--",
                                "--extra", "x y", home=home, bindir=stand_ins(tmp_path),
                                extra_env={"ANTHROPIC_API_KEY": "sk-ant-real"})
    assert code == 0, err
    got = json.loads((home / "record.json").read_text())
    argv, env = got["argv"], got["env"]
    assert Path(argv[0]).name == client and argv[-2:] == ["--extra", "x y"]
    assert got["cwd"] == str(home)
    # nothing written into the user's or the client's files: only what a client can read
    # from a file alone (aider's model metadata), in prefixd's own directory
    assert files_under(home) == sorted(["record.json", *(
        [f".cache/prefixd/launch/aider-fake-{window or 0}.json"] if client == "aider" else [])])
    text = json.dumps(got)
    assert "sk-team" in text and url in text and "fake" in text
    assert "sk-ant-real" not in json.dumps({k: v for k, v in env.items()
                                            if k != "ANTHROPIC_API_KEY"})
    if client == "claude":
        assert env["ANTHROPIC_BASE_URL"] == url and env["ANTHROPIC_MODEL"] == "fake"
        assert env["ANTHROPIC_SMALL_FAST_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "fake"
        assert env["DISABLE_TELEMETRY"] == env["DISABLE_AUTOUPDATER"] == "1"
        # a bearer token, not a key: no "use this API key?" dialog on every start
        assert env["ANTHROPIC_AUTH_TOKEN"] == "sk-team" and "ANTHROPIC_API_KEY" not in env
        # no classifier calls to the local model (auto mode), per run
        settings = json.loads(argv[argv.index("--settings") + 1])
        assert settings == {"permissions": {"disableAutoMode": "disable"}}
        assert env.get("CLAUDE_CODE_MAX_CONTEXT_TOKENS") == (str(window) if window else None)
        assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in env     # read as 100K below 100K
    elif client == "codex":
        assert "check_for_update_on_startup=false" in argv and 'model="fake"' in argv
        assert env["PREFIXD_API_KEY"] == "sk-team"
        assert (f"model_context_window={window}" in argv) is bool(window)
    elif client == "opencode":
        config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
        assert config["model"] == "prefixd/fake" and config["autoupdate"] is False
        assert config["provider"]["prefixd"]["options"]["baseURL"] == url + "/v1"
    else:
        assert argv[argv.index("--model") + 1] == "openai/fake"
        # per run: `--analytics-disable` would write aider's config for good
        assert "--no-analytics" in argv and "--analytics-disable" not in argv
        assert "--no-check-update" in argv
        # aider fetches a price list for a model no metadata names: this one names it
        meta = json.loads(Path(argv[argv.index("--model-metadata-file") + 1]).read_text())
        assert meta["openai/fake"].get("max_input_tokens") == window
        assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"     # litellm's bundled list


async def test_print_writes_nothing(upstream, start_proxy, tmp_path):
    """`--print` only prints: the file aider reads is a line of the profile, not written."""
    proxy = await start_proxy(upstream.url, backend={"context_window": 8192})
    code, out, err = await launch("aider", "--url", f"http://127.0.0.1:{proxy.port}",
                                  "--print", home=tmp_path)
    assert code == 0, err
    assert files_under(tmp_path) == []
    assert any(line.startswith("mkdir -p ") and "aider-fake-8192.json" in line
               for line in out.splitlines())


async def test_a_users_own_permission_choice_is_kept(upstream, start_proxy, tmp_path):
    proxy = await start_proxy(upstream.url)
    code, out, err = await launch("claude", "--url", f"http://127.0.0.1:{proxy.port}",
                                  "--print", "--", "--permission-mode", "acceptEdits",
                                  home=tmp_path)
    assert code == 0, err
    assert out.strip().splitlines()[-1] == "claude --permission-mode acceptEdits"


async def test_launch_right_after_serve_waits_for_prefixd(upstream, tmp_path):
    """`prefixd launch` started before the daemon listens: it says it waits, then gets the
    model and its window (issue 33: it started the client with no window)."""
    port = free_port()
    task = asyncio.create_task(launch("claude", "--url", f"http://127.0.0.1:{port}", "--print",
                                      home=tmp_path))
    await asyncio.sleep(1.0)         # launch is polling a port nothing listens on yet
    assert not task.done()
    settings = Settings(_env_file=None, backends=[
        {"name": "up", "kind": "openai", "url": upstream.url, "models": ["fake"],
         "context_window": 16384}])
    server = Server(make_proxy(settings, build_backends(settings.backends, settings)))
    await server.start("127.0.0.1", port)
    try:
        code, out, err = await task
    finally:
        await server.shutdown(1.0)
    assert code == 0, err
    assert "waiting for prefixd" in err
    assert "export CLAUDE_CODE_MAX_CONTEXT_TOKENS=16384" in out.splitlines()


async def test_run_launch_keeps_the_callers_directory(upstream, start_proxy, tmp_path):
    proxy = await start_proxy(upstream.url)
    work = tmp_path / "project"
    work.mkdir()
    code, _, err = await launch("aider", "--url", f"http://127.0.0.1:{proxy.port}",
                                home=work, bindir=stand_ins(tmp_path),
                                argv0=["bash", str(REPO / "run")])
    assert code == 0, err
    assert json.loads((work / "record.json").read_text())["cwd"] == str(work)


async def test_print_gives_lines_for_a_shell_profile(upstream, start_proxy, tmp_path):
    proxy = await start_proxy(upstream.url)
    code, out, err = await launch("claude", "--url", f"http://127.0.0.1:{proxy.port}",
                                  "--print", home=tmp_path)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[-1].startswith("claude --settings ")
    assert "unset ANTHROPIC_API_KEY" in lines
    assert f"export ANTHROPIC_BASE_URL=http://127.0.0.1:{proxy.port}" in lines
    assert "export ANTHROPIC_MODEL=fake" in lines and "export DISABLE_TELEMETRY=1" in lines


async def test_the_model_is_the_only_one_or_named(upstream, start_proxy, tmp_path):
    proxy = await start_proxy(backends=[
        {"name": n, "kind": "openai", "url": upstream.url, "models": [n]} for n in ("a", "b")])
    url = f"http://127.0.0.1:{proxy.port}"
    code, _, err = await launch("codex", "--url", url, "--print", home=tmp_path)
    assert code == 2 and "--model" in err and "'a'" in err and "'b'" in err
    code, _, err = await launch("codex", "--url", url, "--model", "c", "--print", home=tmp_path)
    assert code == 2 and "'c' is not served" in err
    code, out, _ = await launch("codex", "--url", url, "--model", "b", "--print", home=tmp_path)
    assert code == 0 and 'model="b"' in out


async def test_no_prefixd_and_no_client_are_named(tmp_path, upstream, start_proxy):
    code, _, err = await launch("claude", "--url", "http://127.0.0.1:1", "--wait", "0",
                                home=tmp_path)
    assert code == 2 and "no prefixd answers" in err and "./run serve" in err
    proxy = await start_proxy(upstream.url)
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = await launch("opencode", "--url", f"http://127.0.0.1:{proxy.port}",
                                home=tmp_path, path=str(empty))
    assert code == 2 and "opencode is not on PATH" in err
    assert "npm install -g opencode-ai" in err


def test_a_known_window_reaches_each_client() -> None:
    t = Target("http://127.0.0.1:8400", "k", "m", 8192)
    env = RECIPES["claude"](t, []).env
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "8192"
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in env
    assert int(env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) < 8192
    big = RECIPES["claude"](Target(t.url, "k", "m", 262144), []).env
    assert big["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == big["CLAUDE_CODE_MAX_CONTEXT_TOKENS"]
    assert "model_context_window=8192" in RECIPES["codex"](t, []).argv
    config = json.loads(RECIPES["opencode"](t, []).env["OPENCODE_CONFIG_CONTENT"])
    assert config["provider"]["prefixd"]["models"]["m"]["limit"]["context"] == 8192
    plan = RECIPES["aider"](t, [])
    meta = plan.argv[plan.argv.index("--model-metadata-file") + 1]
    assert json.loads(plan.files[Path(meta)])["openai/m"]["max_input_tokens"] == 8192
