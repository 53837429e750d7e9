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

from prefixd.proxy.launch import RECIPES, Target

RECORDER = """#!{python}
import json, os, sys
with open(os.environ["LAUNCH_RECORD"], "w") as f:
    json.dump({{"argv": sys.argv, "env": dict(os.environ)}}, f)
"""


async def launch(*args: str, home: Path, bindir: Path | None = None,
                 path: str | None = None) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    env.update(HOME=str(home), LAUNCH_RECORD=str(home / "record.json"))
    if bindir is not None:
        env["PATH"] = f"{bindir}:{env.get('PATH', '')}"
    if path is not None:
        env["PATH"] = path
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixd.proxy.cli", "launch", *args, env=env, cwd=home,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
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
async def test_each_client_is_started_configured_and_nothing_is_written(
        client, upstream, start_proxy, tmp_path):
    proxy = await start_proxy(upstream.url, api_key="sk-team")
    home = tmp_path / "home"
    home.mkdir()
    url = f"http://127.0.0.1:{proxy.port}"
    code, _, err = await launch(client, "--url", url, "--api-key", "sk-team", "--",
                                "--extra", "x y", home=home, bindir=stand_ins(tmp_path))
    assert code == 0, err
    got = json.loads((home / "record.json").read_text())
    argv, env = got["argv"], got["env"]
    assert Path(argv[0]).name == client and argv[-2:] == ["--extra", "x y"]
    assert files_under(home) == ["record.json"]      # no config of the user's was written
    text = json.dumps(got)
    assert "sk-team" in text and url in text and "fake" in text
    if client == "claude":
        assert env["ANTHROPIC_BASE_URL"] == url and env["ANTHROPIC_MODEL"] == "fake"
        assert env["ANTHROPIC_SMALL_FAST_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "fake"
        assert env["DISABLE_TELEMETRY"] == env["DISABLE_AUTOUPDATER"] == "1"
        assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in env      # no window known here
    elif client == "codex":
        assert "check_for_update_on_startup=false" in argv and 'model="fake"' in argv
        assert env["PREFIXD_API_KEY"] == "sk-team"
    elif client == "opencode":
        config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
        assert config["model"] == "prefixd/fake" and config["autoupdate"] is False
        assert config["provider"]["prefixd"]["options"]["baseURL"] == url + "/v1"
    else:
        assert argv[argv.index("--model") + 1] == "openai/fake"
        assert "--analytics-disable" in argv and "--no-check-update" in argv


async def test_print_gives_lines_for_a_shell_profile(upstream, start_proxy, tmp_path):
    proxy = await start_proxy(upstream.url)
    code, out, err = await launch("claude", "--url", f"http://127.0.0.1:{proxy.port}",
                                  "--print", home=tmp_path)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[-1] == "claude"
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
    code, _, err = await launch("claude", "--url", "http://127.0.0.1:1", home=tmp_path)
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
    assert RECIPES["claude"](t, []).env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "8192"
    assert "model_context_window=8192" in RECIPES["codex"](t, []).argv
    config = json.loads(RECIPES["opencode"](t, []).env["OPENCODE_CONFIG_CONTENT"])
    assert config["provider"]["prefixd"]["models"]["m"]["limit"]["context"] == 8192
    plan = RECIPES["aider"](t, [])
    meta = plan.argv[plan.argv.index("--model-metadata-file") + 1]
    assert json.loads(plan.files[Path(meta)])["openai/m"]["max_input_tokens"] == 8192
