"""Real coding agents, headless, through a real `prefixd serve`: Claude Code (`claude -p`,
Anthropic Messages) and Codex (`codex exec`, OpenAI Responses).

Opt-in: `PREFIXD_REAL_CLIENTS=1 ./run test -s tests/test_real_clients.py` (needs node and npm;
installs the pinned packages once into `~/.cache/prefixd/npm`, or `PREFIXD_NPM_DIR`).

- default model: prefixd's own default (the built-in SmolLM2 managed worker). It cannot use
  tools, so each agent completes one turn, with a short system prompt and no tools where the
  agent allows (SmolLM2's context is 8192 tokens, and on a CPU without OpenBLAS its prefill
  runs at a few tokens per second).
- scripted upstream: a fake OpenAI upstream answers each agent with tool calls the agent
  executes (a shell `echo hi`, a file read, a shell `wc`), then a final text; each turn's
  prefix report (from `/debug/prefix/{lane}`) is printed, and every turn after the first
  must have been sent as an APPEND: the prefix survived the round trip through the agent.

Everything listens on 127.0.0.1; every process started here is stopped by its PID; each
agent run has a time limit (`PREFIXD_REAL_CLIENTS_TIMEOUT`, default 1800 s for the default
model, 300 s against the scripted upstream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fake_upstream import FakeUpstream

from prefixd.backends.supervision.process import free_port
from prefixd.proxy.prefix.detect import Verdict
from prefixd.proxy.prefix.report import PrefixReport, header

REAL = os.environ.get("PREFIXD_REAL_CLIENTS") == "1"
pytestmark = [
    pytest.mark.skipif(not REAL, reason="real agents are opt-in: PREFIXD_REAL_CLIENTS=1"),
    pytest.mark.skipif(not (shutil.which("node") and shutil.which("npm")),
                       reason="needs node and npm"),
    pytest.mark.slow, pytest.mark.network, pytest.mark.timeout(7200),
]

NPM_DIR = Path(os.environ.get("PREFIXD_NPM_DIR", "~/.cache/prefixd/npm")).expanduser()
PACKAGES = {"claude": "@anthropic-ai/claude-code@2.1.197", "codex": "@openai/codex@0.169.0",
            "opencode": "opencode-ai@1.18.33"}
KEY = "sk-local"
DEFAULT_TIMEOUT = float(os.environ.get("PREFIXD_REAL_CLIENTS_TIMEOUT", "1800"))
SCRIPTED_TIMEOUT = 300.0
NOTES = "prefixd notes: the prefix survives.\n"
FINAL = "All done: echo printed hi and the notes file has one line."


# --- the agents -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agents() -> dict[str, Path]:
    """The agents' executables, installed once into NPM_DIR (pinned versions)."""
    bins = {name: NPM_DIR / "node_modules" / ".bin" / name for name in PACKAGES}
    if not all(b.exists() for b in bins.values()):
        NPM_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(NPM_DIR),
                        *PACKAGES.values()], check=True, timeout=900)
    for name, b in bins.items():
        version = subprocess.run([str(b), "--version"], capture_output=True, text=True,
                                 timeout=60, check=True).stdout.strip()
        print(f"{name}: {version}")
    return bins


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str


async def run_agent(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> Run:
    """One agent process, in its own process group, stopped by its PID when time is up."""
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        await stop(proc)
        out, err = await proc.communicate()
        raise AssertionError(f"{argv[0]} did not finish in {timeout:g}s; stderr: "
                             f"{err.decode(errors='replace')[-2000:]}") from None
    finally:
        await stop(proc)
    return Run(proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))


async def stop(proc: asyncio.subprocess.Process, grace: float = 10.0) -> None:
    """SIGTERM to the process (by its PID), SIGKILL after `grace`; then SIGKILL whatever it
    left behind in the process group it leads (started with start_new_session)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def base_env(home: Path) -> dict[str, str]:
    """A clean environment: nothing from the user's own agent configuration leaks in."""
    node = str(Path(shutil.which("node") or "/usr/bin/node").parent)
    return {"PATH": f"{node}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
            "LANG": "C.UTF-8", "TERM": "dumb", "TMPDIR": str(home)}


def claude(bin_: Path, base: str, model: str, home: Path, *args: str) -> tuple[list[str], dict]:
    env = {**base_env(home), "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": KEY,
           "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
           "ANTHROPIC_DEFAULT_SONNET_MODEL": model, "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
           "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1"}
    return [str(bin_), "-p", *args], env


def codex(bin_: Path, base: str, model: str, home: Path, prompt: str,
          extra_config: str = "") -> tuple[list[str], dict]:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(f"""\
model = "{model}"
model_provider = "prefixd"
check_for_update_on_startup = false
{extra_config}
[model_providers.prefixd]
name = "prefixd"
base_url = "{base}/v1"
wire_api = "responses"
env_key = "PREFIXD_API_KEY"
""")
    env = {**base_env(home), "CODEX_HOME": str(codex_home), "PREFIXD_API_KEY": KEY}
    return [str(bin_), "exec", "--skip-git-repo-check", "--color", "never", prompt], env


# --- prefixd ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def serve(env: dict[str, str], ready_timeout: float) -> AsyncIterator[str]:
    """`prefixd serve` on a free loopback port; its base URL once /ready says so."""
    port = free_port()
    exe = Path(sys.executable).parent / "prefixd"
    full = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    full.update({"PREFIXD_API_KEY": KEY, "PREFIXD_LOG_LEVEL": "INFO", **env})
    proc = await asyncio.create_subprocess_exec(
        str(exe), "serve", "--host", "127.0.0.1", "--port", str(port), env=full,
        stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            deadline = asyncio.get_running_loop().time() + ready_timeout
            while True:
                assert proc.returncode is None, f"prefixd exited with {proc.returncode}"
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.get(base + "/ready") as r:
                        if r.status == 200:
                            break
                assert asyncio.get_running_loop().time() < deadline, "prefixd never got ready"
                await asyncio.sleep(0.5)
        yield base
    finally:
        await stop(proc, grace=30.0)


async def reports(base: str) -> dict[str, list[dict[str, Any]]]:
    """Every lane's prefix reports, oldest first."""
    auth = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=auth) as s:
        async with s.get(base + "/debug/prefix") as r:
            assert r.status == 200, await r.text()
            lanes = [lane["lane"] for lane in (await r.json())["lanes"]]
        out = {}
        for lane in lanes:
            async with s.get(f"{base}/debug/prefix/{lane}") as r:
                out[lane] = (await r.json())["reports"]
    return out


def report_header(r: dict[str, Any]) -> str:
    """The `X-Prefixd-Prefix` value that turn was answered with."""
    fields = {**r, "verdict": Verdict(r["verdict"]), "sent_verdict": Verdict(r["sent_verdict"])}
    return header(PrefixReport(**fields))


def show(title: str, lanes: dict[str, list[dict[str, Any]]]) -> None:
    print(f"\n== {title}")
    for lane, history in lanes.items():
        for r in history:
            print(f"{lane} turn {r['turn']}: {report_header(r)}")


def main_lane(lanes: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return max(lanes.values(), key=len)


def assert_prefix_survived(history: list[dict[str, Any]], turns: int) -> None:
    assert [r["turn"] for r in history] == list(range(1, turns + 1)), history
    assert history[0]["verdict"] == "NEW"
    broken = [f"turn {r['turn']}: {report_header(r)}" for r in history[1:]
              if r["sent_verdict"] != "APPEND"]
    assert not broken, "the prefix did not survive:\n" + "\n".join(broken)


def assert_no_wrong_verdict(lanes: dict[str, list[dict[str, Any]]],
                            echo_drift: bool = False) -> None:
    """Every turn of every lane is NEW or APPEND (`echo_drift`: or APPEND+ECHO_DRIFT, a
    client re-serializing what it echoes): no side call or sub-agent reported as a mutation
    of another conversation."""
    ok = ("NEW", "APPEND", *(("APPEND+ECHO_DRIFT",) if echo_drift else ()))
    wrong = [f"{lane} turn {r['turn']}: {report_header(r)}" for lane, history in lanes.items()
             for r in history if r["verdict"] not in ok]
    assert not wrong, "\n".join(wrong)


# --- the scripted upstream ---------------------------------------------------------------------


def _tool_results(body: dict[str, Any]) -> int:
    return sum(1 for m in body.get("messages", []) if m.get("role") == "tool")


def _reply(content: str | None = None, reasoning: str | None = None,
           call: tuple[str, str, dict[str, Any]] | None = None,
           prompt: int = 1, cached: int = 0) -> dict[str, Any]:
    calls = [] if call is None else [{"id": call[0], "name": call[1],
                                      "arguments": json.dumps(call[2])}]
    return {"reply": {"content": content, "reasoning": reasoning, "tool_calls": calls},
            "usage": {"prompt_tokens": prompt, "cached_tokens": cached}}


def claude_steps(notes: Path) -> list[tuple[str, dict[str, Any]]]:
    return [("Bash", {"command": "echo hi", "description": "Print hi"}),
            ("Read", {"file_path": str(notes)}),
            ("Bash", {"command": f"wc -l {notes}", "description": "Count lines"})]


def codex_steps(notes: Path) -> list[tuple[str, dict[str, Any]]]:
    return [("exec_command", {"cmd": "echo hi"}),
            ("exec_command", {"cmd": f"cat {notes}"}),
            ("exec_command", {"cmd": f"wc -l {notes}"})]


def responder(steps: list[tuple[str, dict[str, Any]]], tool: str, prefix: str):  # type: ignore[no-untyped-def]
    """The upstream's answer to an agent's request: the next tool call of `steps` (by how
    many tool results the conversation holds), then the final text. A request that does not
    offer `tool` (a side call: a title, a summary) gets a short text. Usage is what a caching
    backend would report: prompt ~ chars/4, the previous main request's prompt cached."""
    last = [0]

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        prompt = max(len(json.dumps(body)) // 4, 1)
        names = [t.get("function", {}).get("name") for t in body.get("tools") or []]
        if tool not in names:
            return _reply("ok", prompt=prompt)
        cached, last[0] = min(last[0], prompt), prompt
        n = _tool_results(body)
        if n < len(steps):
            name, args = steps[n]
            return _reply(reasoning=f"Step {n + 1}: I will call {name}." if n == 0 else None,
                          content=f"Running step {n + 1}.",
                          call=(f"call_{prefix}{n + 1}", name, args), prompt=prompt,
                          cached=cached)
        return _reply(FINAL, prompt=prompt, cached=cached)
    return answer


@pytest.fixture
async def scripted() -> AsyncIterator[FakeUpstream]:
    up = FakeUpstream()
    await up.start()
    try:
        yield up
    finally:
        await up.stop()


def scripted_env(up: FakeUpstream) -> dict[str, str]:
    return {"PREFIXD_BACKENDS": json.dumps([{"name": "scripted", "kind": "openai",
                                             "url": up.url, "models": ["scripted"]}])}


def workdir(tmp_path: Path) -> tuple[Path, Path, Path]:
    home, proj = tmp_path / "home", tmp_path / "proj"
    home.mkdir()
    proj.mkdir()
    notes = proj / "notes.txt"
    notes.write_text(NOTES)
    return home, proj, notes


# --- the tests --------------------------------------------------------------------------------


async def test_claude_code_scripted_tool_turns(agents: dict[str, Path], scripted: FakeUpstream,
                                               tmp_path: Path) -> None:
    home, proj, notes = workdir(tmp_path)
    steps = claude_steps(notes)
    scripted.responder = responder(steps, "Bash", "cc")
    async with serve(scripted_env(scripted), 60) as base:
        argv, env = claude(agents["claude"], base, "scripted", home,
                           "Run echo hi, read notes.txt, then count its lines.",
                           "--allowedTools", "Bash", "Read")
        run = await run_agent(argv, env, proj, SCRIPTED_TIMEOUT)
        lanes = await reports(base)
    show("Claude Code, scripted upstream", lanes)
    print("claude stdout:", run.stdout.strip())
    assert run.rc == 0, run.stderr[-3000:]
    assert FINAL in run.stdout
    main = [b for b in scripted.received if "Bash" in json.dumps(b.get("tools", []))]
    assert len(main) == len(steps) + 1
    last = main[-1]["messages"]
    results = [m for m in last if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == [f"call_cc{i}" for i in (1, 2, 3)]
    assert "hi" in results[0]["content"] and "the prefix survives" in results[1]["content"]
    assert_prefix_survived(main_lane(lanes), len(steps) + 1)


async def test_claude_code_side_calls_get_their_own_lanes(agents: dict[str, Path],
                                                          scripted: FakeUpstream,
                                                          tmp_path: Path) -> None:
    """Non-essential traffic on (as a user runs it): Claude Code sends a session-title call
    (same session id, no tools) beside its main turns. It gets a lane of its own: no verdict
    of any lane says MUTATED, and the main conversation's turns are APPENDs."""
    home, proj, notes = workdir(tmp_path)
    steps = claude_steps(notes)
    scripted.responder = responder(steps, "Bash", "cc")
    async with serve(scripted_env(scripted), 60) as base:
        argv, env = claude(agents["claude"], base, "scripted", home,
                           "Run echo hi, read notes.txt, then count its lines.",
                           "--allowedTools", "Bash", "Read")
        del env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"]
        run = await run_agent(argv, env, proj, SCRIPTED_TIMEOUT)
        lanes = await reports(base)
    show("Claude Code, non-essential traffic on", lanes)
    assert run.rc == 0, run.stderr[-3000:]
    side = [b for b in scripted.received if not b.get("tools")]
    assert side, "no side call was sent: nothing tested"
    assert_no_wrong_verdict(lanes)
    assert_prefix_survived(main_lane(lanes), len(steps) + 1)
    assert len(lanes) >= 2


async def test_claude_code_through_prefixd_launch(agents: dict[str, Path],
                                                  scripted: FakeUpstream,
                                                  tmp_path: Path) -> None:
    """`prefixd launch claude -- -p ...`: the real client, configured by launch alone (no
    variable set by hand), its side calls on: every request answered, every verdict right."""
    home, proj, notes = workdir(tmp_path)
    steps = claude_steps(notes)
    scripted.responder = responder(steps, "Bash", "cc")
    async with serve(scripted_env(scripted), 60) as base:
        env = base_env(home)
        env["PATH"] = f"{agents['claude'].parent}:{env['PATH']}"
        argv = [sys.executable, "-m", "prefixd.proxy.cli", "launch", "claude", "--url", base,
                "--api-key", KEY, "--", "-p",
                "Run echo hi, read notes.txt, then count its lines.",
                "--allowedTools", "Bash", "Read"]
        run = await run_agent(argv, env, proj, SCRIPTED_TIMEOUT)
        lanes = await reports(base)
    show("Claude Code through prefixd launch", lanes)
    assert run.rc == 0, run.stderr[-3000:]
    assert FINAL in run.stdout
    assert_no_wrong_verdict(lanes)
    assert_prefix_survived(main_lane(lanes), len(steps) + 1)


async def test_codex_exec_then_resume_through_prefixd_launch(agents: dict[str, Path],
                                                            scripted: FakeUpstream,
                                                            tmp_path: Path) -> None:
    """`prefixd launch codex -- exec ...`, then `-- exec resume --last ...`: the resumed
    session continues its lane; every request answered, every verdict right."""
    home, proj, notes = workdir(tmp_path)
    steps = codex_steps(notes)
    scripted.responder = responder(steps, "exec_command", "cx")
    async with serve(scripted_env(scripted), 60) as base:
        env = base_env(home)
        env["PATH"] = f"{agents['codex'].parent}:{env['PATH']}"
        launch = [sys.executable, "-m", "prefixd.proxy.cli", "launch", "codex", "--url", base,
                  "--api-key", KEY, "--", "exec", "--skip-git-repo-check"]
        first = await run_agent([*launch, "Run echo hi, then cat notes.txt, then count its "
                                 "lines."], env, proj, SCRIPTED_TIMEOUT)
        scripted.responder = responder([], "exec_command", "cy")
        again = await run_agent([*launch[:-2], "exec", "resume", "--last",
                                 "--skip-git-repo-check", "Now say done."], env, proj,
                                SCRIPTED_TIMEOUT)
        lanes = await reports(base)
    show("Codex exec + resume through prefixd launch", lanes)
    assert first.rc == 0, first.stderr[-3000:]
    assert again.rc == 0, again.stderr[-3000:]
    assert_no_wrong_verdict(lanes)
    assert_prefix_survived(main_lane(lanes), len(steps) + 2)


def sub_agent_responder():  # type: ignore[no-untyped-def]
    """The main conversation (every tool, the Agent tool among them) starts a sub-agent, then
    ends; the sub-agent (fewer tools) and side calls (none) answer at once."""
    def answer(body: dict[str, Any]) -> dict[str, Any]:
        names = [t.get("function", {}).get("name") for t in body.get("tools") or []]
        prompt = max(len(json.dumps(body)) // 4, 1)
        if "Agent" in names and len(names) >= 25:
            if _tool_results(body) == 0:
                return _reply(content="Starting a sub-agent.", prompt=prompt, call=(
                    "call_ag1", "Agent", {"description": "Say hi", "subagent_type":
                                          "general-purpose",
                                          "prompt": "Reply with the single word hi."}))
            return _reply(FINAL, prompt=prompt)
        return _reply("hi" if names else "ok", prompt=prompt)
    return answer


async def test_claude_code_sub_agent_and_title_calls_get_their_own_lanes(
        agents: dict[str, Path], scripted: FakeUpstream, tmp_path: Path) -> None:
    """A prompt that starts a sub-agent, non-essential traffic on: the title call, the
    sub-agent and the main conversation each in a lane of its own, every verdict right."""
    home, proj, _ = workdir(tmp_path)
    scripted.responder = sub_agent_responder()
    async with serve(scripted_env(scripted), 60) as base:
        argv, env = claude(agents["claude"], base, "scripted", home,
                           "Use a sub-agent to say hi.")
        del env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"]
        run = await run_agent(argv, env, proj, SCRIPTED_TIMEOUT)
        lanes = await reports(base)
    show("Claude Code, a sub-agent and a title call", lanes)
    assert run.rc == 0, run.stderr[-3000:]
    kinds = {len(b.get("tools") or []) for b in scripted.received}
    assert len(kinds) >= 3, kinds                 # title (0), main, sub-agent: all sent
    assert_no_wrong_verdict(lanes)
    assert len(lanes) >= 3
    assert_prefix_survived(main_lane(lanes), 2)


async def test_opencode_through_prefixd_launch(agents: dict[str, Path], scripted: FakeUpstream,
                                               tmp_path: Path) -> None:
    """`prefixd launch opencode -- run ...`: its title call in a lane of its own, the main
    conversation's turns reuse their whole prefix (APPEND; OpenCode re-serializes the tool
    arguments it echoes, which prefixd names: `tool_args_reserialized`)."""
    home, proj, notes = workdir(tmp_path)
    steps = [("bash", {"command": "echo hi", "description": "Print hi"}),
             ("read", {"filePath": str(notes)})]
    scripted.responder = responder(steps, "bash", "oc")
    async with serve(scripted_env(scripted), 60) as base:
        env = base_env(home)
        env["PATH"] = f"{agents['opencode'].parent}:{env['PATH']}"
        argv = [sys.executable, "-m", "prefixd.proxy.cli", "launch", "opencode", "--url", base,
                "--api-key", KEY, "--", "run", "Run echo hi, then read notes.txt."]
        run = await run_agent(argv, env, proj, SCRIPTED_TIMEOUT)
        lanes = await reports(base)
    show("OpenCode through prefixd launch", lanes)
    assert run.rc == 0, run.stderr[-3000:]
    assert FINAL in run.stdout
    assert_no_wrong_verdict(lanes, echo_drift=True)
    main = main_lane(lanes)
    assert len(main) == len(steps) + 1 and all(r["reusable_tokens"] == r["prev_prompt_tokens"]
                                               for r in main[1:])
    assert len(lanes) >= 2                      # the title call's lane


async def test_codex_scripted_tool_turns(agents: dict[str, Path], scripted: FakeUpstream,
                                         tmp_path: Path) -> None:
    home, proj, notes = workdir(tmp_path)
    steps = codex_steps(notes)
    scripted.responder = responder(steps, "exec_command", "cx")
    async with serve(scripted_env(scripted), 60) as base:
        argv, env = codex(agents["codex"], base, "scripted", home,
                          "Run echo hi, read notes.txt, then count its lines.")
        run = await run_agent(argv, env, proj, SCRIPTED_TIMEOUT)
        lanes = await reports(base)
    show("Codex, scripted upstream", lanes)
    print("codex stdout:", run.stdout.strip())
    assert run.rc == 0, run.stderr[-3000:]
    assert FINAL in run.stdout
    main = [b for b in scripted.received if "exec_command" in json.dumps(b.get("tools", []))]
    assert len(main) == len(steps) + 1
    results = [m for m in main[-1]["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == [f"call_cx{i}" for i in (1, 2, 3)]
    assert "hi" in results[0]["content"] and "the prefix survives" in results[1]["content"]
    assert_prefix_survived(main_lane(lanes), len(steps) + 1)


async def test_claude_code_default_model_one_turn(agents: dict[str, Path],
                                                  tmp_path: Path) -> None:
    home, proj, _ = workdir(tmp_path)
    async with serve({}, DEFAULT_TIMEOUT) as base:
        model = await served_model(base)
        argv, env = claude(agents["claude"], base, model, home,
                           "What is the capital of France? Answer in one sentence.",
                           "--tools", "", "--system-prompt", "You are a helpful assistant.")
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = "128"
        run = await run_agent(argv, env, proj, DEFAULT_TIMEOUT)
        lanes = await reports(base)
        answered = await answered_200(base)
    show(f"Claude Code, default model {model}", lanes)
    print("claude stdout:", run.stdout.strip())
    assert run.rc == 0, run.stderr[-3000:]
    assert run.stdout.strip() and answered == 1
    assert main_lane(lanes)[0]["verdict"] == "NEW"


async def test_codex_default_model_one_turn(agents: dict[str, Path], tmp_path: Path) -> None:
    """Codex sends no temperature and no output limit: the worker samples at temperature 1
    up to PREFIXD_MAX_TOKENS_DEFAULT (set low here to bound the run). A 135M model may use
    them all; prefixd then ends the turn `response.incomplete` (max_output_tokens), which
    Codex reports as an error: the turn still completed through prefixd."""
    home, proj, _ = workdir(tmp_path)
    instructions = home / "instructions.md"
    instructions.write_text("You are a helpful assistant. Answer briefly.\n")
    async with serve({"PREFIXD_MAX_TOKENS_DEFAULT": "96"}, DEFAULT_TIMEOUT) as base:
        model = await served_model(base)
        argv, env = codex(agents["codex"], base, model, home,
                          "What is the capital of France? Answer in one sentence.",
                          extra_config=f'model_instructions_file = "{instructions}"\n'
                                       "model_context_window = 8192\n")
        run = await run_agent(argv, env, proj, DEFAULT_TIMEOUT)
        lanes = await reports(base)
        answered = await answered_200(base)
    show(f"Codex, default model {model}", lanes)
    print("codex stdout:", run.stdout.strip() or "(none)")
    incomplete = "Incomplete response returned, reason: max_output_tokens" in run.stderr
    if incomplete:
        print("codex: the model used all PREFIXD_MAX_TOKENS_DEFAULT tokens (incomplete)")
    assert run.rc == 0 or incomplete, run.stderr[-3000:]
    assert answered == 1
    assert main_lane(lanes)[0]["verdict"] == "NEW"


async def served_model(base: str) -> str:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s, \
            s.get(base + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]


async def answered_200(base: str) -> int:
    """How many requests prefixd answered 200 (its own metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s, \
            s.get(base + "/metrics") as r:
        text = await r.text()
    return round(sum(x.value for f in text_string_to_metric_families(text)
                     if f.name == "prefixd_requests" for x in f.samples
                     if x.name == "prefixd_requests_total" and x.labels.get("status") == "200"))
