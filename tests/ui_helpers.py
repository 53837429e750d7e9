"""Shared by tests/test_ui_browser.py, tests/test_explain.py and bench/screenshot.py:
multi-turn conversations that give the status page something to show (played through a real
prefixd in front of tests/fake_upstream.py), headless Chromium, and a small DOM reader."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import aiohttp

CHAT = "/v1/chat/completions"
FILLER = "Use the tools wisely and keep answers short. " * 40


def backends(url: str) -> list[dict[str, Any]]:
    """Two OpenAI-kind backends (both on the fake upstream), each serving one model."""
    return [{"name": "llama-server", "kind": "openai", "url": url, "models": ["qwen3-coder-30b"]},
            {"name": "vllm-gpu", "kind": "openai", "url": url, "models": ["gpt-oss-20b"],
             "max_concurrency": 4}]


def goose_system(stamp: str) -> str:
    return (f"You are a general-purpose AI agent called goose.\n\nThe current date is {stamp}."
            f"\n\n{FILLER}")


def cc_system(cch: str) -> str:
    return (f"x-anthropic-billing-header: cc_version=2.1.37.3f1; cc_entrypoint=cli; cch={cch};\n"
            f"You are Claude Code, Anthropic's official CLI for Claude.\n{FILLER}")


def tools(order: list[str]) -> list[dict]:
    return [{"type": "function", "function": {
        "name": n, "description": f"{n} a file or run a command",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
        for n in order]


@dataclass
class Conversation:
    """One client's conversation; `turn()` sends the next request and records the answer."""

    headers: dict[str, str]
    model: str
    system: str
    tools: list[dict] | None = None
    history: list[dict] = field(default_factory=list)
    prompt_tokens: int = 0

    async def turn(self, http: aiohttp.ClientSession, base: str, user: str, *,
                   system: str | None = None, tools: list[dict] | None = None,
                   cached: int | None = None, key: str | None = None) -> str:
        self.system = system or self.system
        self.tools = tools or self.tools
        messages = [{"role": "system", "content": self.system}, *self.history,
                    {"role": "user", "content": user}]
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            body["tools"] = self.tools
        prompt = len(json.dumps(body)) // 4
        # what a caching backend would report: the previous prompt, unless told otherwise
        reuse = self.prompt_tokens if cached is None else cached
        body["fake"] = {"usage": {"prompt_tokens": prompt, "cached_tokens": reuse}}
        headers = dict(self.headers)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        async with http.post(base + CHAT, json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            answer = (await r.json())["choices"][0]["message"]["content"]
            prefix_header = r.headers.get("X-Prefixd-Prefix", "")
        self.history += [{"role": "user", "content": user},
                         {"role": "assistant", "content": answer}]
        self.prompt_tokens = prompt
        return prefix_header


async def play(http: aiohttp.ClientSession, base: str, *, key: str | None = None,
               hostile: bool = False) -> None:
    """Five conversations: goose with a clock in its system prompt (MUTATED every turn),
    Claude Code with a moving billing header (repaired by the default strip rule), opencode
    whose tools get reordered (repaired by pin_tool_order), aider editing an earlier message
    (BRANCH), and Cline appending cleanly (played last: the most recently active lane).
    `hostile` adds one whose prompt carries markup, to check that the page never renders it."""
    goose = Conversation({"User-Agent": "goose/1.0.24", "X-Session-Id": "goose-7f3a"},
                         "qwen3-coder-30b", goose_system("2025-05-03 14:22:07"))
    cc = Conversation({"User-Agent": "claude-cli/2.1.37 (external, cli)",
                       "X-Claude-Code-Session-Id": "57a121ec-f78c-48c3-a745-e3036a3ecc33"},
                      "qwen3-coder-30b", cc_system("a1b2c"))
    oc = Conversation({"User-Agent": "opencode/0.15.3", "x-session-affinity": "ses_6aade408"},
                      "gpt-oss-20b", "You are opencode, an interactive CLI agent.\n" + FILLER,
                      tools(["read", "write", "grep", "bash"]))
    cline = Conversation({"User-Agent": "Cline/3.2", "X-Session-Id": "task-1"}, "gpt-oss-20b",
                         "You are Cline, a highly skilled software engineer.\n" + FILLER)
    for i in range(4):
        stamp = f"2025-05-03 14:{22 + i:02d}:{(7 + 40 * i) % 60:02d}"
        await goose.turn(http, base, f"step {i}: look at src/main.py", key=key,
                         system=goose_system(stamp), cached=14 if i else 0)
        await cc.turn(http, base, f"fix the failing test #{i}", key=key,
                      system=cc_system(f"{i:x}f{i * 7:x}9e"))
    await oc.turn(http, base, "find where the config is parsed", key=key)
    await oc.turn(http, base, "now add a --verbose flag", key=key)
    await oc.turn(http, base, "and document it", key=key,
                  tools=tools(["bash", "read", "grep", "write"]))
    aider = Conversation({"User-Agent": "aider/0.80", "X-Session-Id": "aider-42"},
                         "qwen3-coder-30b", "Act as an expert software developer.\n" + FILLER)
    for i in range(3):
        await aider.turn(http, base, f"change {i}: rename the helper", key=key)
    aider.history[2]["content"] = "change 1: rename the helper, and its tests"   # edited
    await aider.turn(http, base, "go on", key=key, cached=0)
    for i in range(5):
        await cline.turn(http, base, f"<task>refactor module {i}</task>", key=key)
    if hostile:
        evil = Conversation({"User-Agent": "aider/0.80", "X-Session-Id": "evil"},
                            "gpt-oss-20b", "")
        for i in range(2):
            sys_prompt = (f'<img src=x onerror="document.title=\'pwned\'"> at 10:0{i}:00 '
                          f"<script>document.title='pwned'</script>\n{FILLER}")
            await evil.turn(http, base, "hi", key=key, system=sys_prompt)


# --- headless Chromium ------------------------------------------------------------------------
def chromium_env() -> dict[str, str]:
    """Our environment without LD_PRELOAD: `./run test` preloads OpenBLAS for MLX, and
    Chromium's GPU process fails to launch with it (error_code=1002)."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def chromium() -> str | None:
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    return next((p for p in map(shutil.which, names) if p), None)


async def run_chromium(profile: Path, *args: str, timeout: float = 120.0) -> bytes:
    """Run headless Chromium with its own profile dir; its stdout (stderr on failure). Its
    GPU process can die on a loaded container ("GPU process isn't usable"): the GPU thread
    runs in the browser process, shared memory is not /dev/shm, and such a crash is retried
    once."""
    binary = chromium()
    assert binary, "no chromium binary"
    for attempt in (1, 2):
        proc = await asyncio.create_subprocess_exec(
            binary, "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
            "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={profile}", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=chromium_env())
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode == 0:
            return out
        if attempt == 2 or b"GPU process isn't usable" not in err:
            break
    raise AssertionError(err.decode(errors="replace")[-2000:])


async def dump_dom(profile: Path, url: str) -> Node:
    out = await run_chromium(profile, "--dump-dom", "--virtual-time-budget=5000", url)
    return parse_html(out.decode())


async def screenshot(profile: Path, url: str, png: Path, size: str = "1280,900") -> None:
    await run_chromium(profile, f"--screenshot={png}", f"--window-size={size}",
                       "--virtual-time-budget=5000", "--force-device-scale-factor=1", url)


class Page:
    """A page in headless Chromium driven over the DevTools protocol (for what --dump-dom
    cannot do: typing into a form, reloading)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.n = ws, 0
        self.events: list[str] = []

    async def _receive(self) -> dict:
        msg = await asyncio.wait_for(self.ws.receive_json(), 30)
        if "method" in msg:
            self.events.append(msg["method"])
        return msg

    async def call(self, method: str, **params: Any) -> dict:
        self.n += 1
        await self.ws.send_json({"id": self.n, "method": method, "params": params})
        while True:
            msg = await self._receive()
            if msg.get("id") == self.n:
                assert "error" not in msg, msg
                return msg["result"]

    async def load(self, method: str, **params: Any) -> None:
        """Page.navigate / Page.reload, returning once the new page has loaded."""
        self.events.clear()
        await self.call(method, **params)
        while "Page.loadEventFired" not in self.events:
            await self._receive()

    async def eval(self, js: str) -> Any:
        res = await self.call("Runtime.evaluate", expression=js, awaitPromise=True,
                              returnByValue=True)
        assert "exceptionDetails" not in res, res["exceptionDetails"]
        return res["result"].get("value")

    async def until(self, condition: str, timeout_ms: int = 15000) -> None:
        """Wait, inside the page, until a JS condition holds (a bounded wait)."""
        await self.eval(f"""new Promise((ok, fail) => {{
            const t0 = Date.now();
            (function check() {{
              try {{ if ({condition}) return ok(true); }} catch (e) {{}}
              if (Date.now() - t0 > {timeout_ms}) return fail(new Error("timeout: {condition}"));
              setTimeout(check, 25);
            }})();
        }})""")


@contextlib.asynccontextmanager
async def open_page(profile: Path, url: str) -> AsyncIterator[Page]:
    binary = chromium()
    assert binary, "no chromium binary"
    proc = await asyncio.create_subprocess_exec(
        binary, "--headless", "--no-sandbox", "--disable-gpu",
        "--disable-dev-shm-usage", "--no-first-run",
        "--no-default-browser-check", "--disable-extensions", "--remote-debugging-port=0",
        f"--user-data-dir={profile}", "about:blank",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=chromium_env())
    assert proc.stderr is not None
    drain: asyncio.Task | None = None
    try:
        endpoint = None
        while endpoint is None:
            line = await asyncio.wait_for(proc.stderr.readline(), 60)
            assert line, "chromium exited before it listened for DevTools"
            m = re.search(rb"DevTools listening on ws://([\d.:]+)/", line)
            endpoint = m and m.group(1).decode()
        drain = asyncio.create_task(proc.stderr.read())       # keep its pipe from filling
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://{endpoint}/json/list") as r:
                targets = await r.json()
            page = next(t for t in targets if t["type"] == "page")
            async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                tab = Page(ws)
                await tab.call("Page.enable")
                await tab.load("Page.navigate", url=url)
                yield tab
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        if drain is not None:
            await drain


# --- a small DOM reader -----------------------------------------------------------------------
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}


@dataclass(eq=False)
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node | str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text for c in self.children)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def all(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> list[Node]:
        """Descendants matching a tag, a class and attributes (`data_lane` -> data-lane)."""
        want = {k.replace("_", "-"): v for k, v in attrs.items()}
        out = []
        for c in self.children:
            if isinstance(c, str):
                continue
            if ((tag is None or c.tag == tag) and (cls is None or cls in c.classes)
                    and all(c.attrs.get(k) == v for k, v in want.items())):
                out.append(c)
            out += c.all(tag, cls, **attrs)
        return out

    def one(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> Node:
        found = self.all(tag, cls, **attrs)
        assert len(found) == 1, f"{len(found)} matches for {tag} .{cls} {attrs}"
        return found[0]


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def parse_html(html: str) -> Node:
    b = _Builder()
    b.feed(html)
    b.close()
    return b.root
