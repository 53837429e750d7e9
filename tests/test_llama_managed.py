"""Backend kind `llama` against a real llama-server (issue 50): prefixd starts it on the built-in
SmolLM2 GGUF, pins every turn to the slot holding its prefix, moves conversations through slot
files when there are more than slots, keeps them across its own restart and a swap, survives a
SIGKILL of the server, and counts a damaged file as a miss with the right answer.

The binary is found as prefixd finds it (PREFIXD_LLAMA_SERVER, PATH, or what
`bench/build_llama_server.sh` built under ~/.cache/prefixd; `.ci/run` builds it once): without
one every test here is skipped, saying so.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from prefixd.backends.llama import command as cmd
from prefixd.backends.llama.managed import LlamaBackend
from prefixd.backends.registry import build_backends
from prefixd.proxy.server import Server, make_proxy
from prefixd.proxy.settings import Settings

pytestmark = pytest.mark.network
CACHE = Path(os.environ.get("PREFIXD_TEST_CACHE_DIR", "~/.cache/prefixd-test")).expanduser()
WORDS = ["parser", "socket", "buffer", "token", "module", "retry", "index", "cache", "queue"]


@pytest.fixture(scope="module")
def binary() -> Path:
    try:
        return cmd.find_binary(os.environ.get("PREFIXD_LLAMA_SERVER"),
                               Path(os.environ.get("PREFIXD_CACHE_DIR", "~/.cache/prefixd")))
    except cmd.LlamaSetupError as e:
        pytest.skip(f"no llama-server: {e}")


@pytest.fixture(scope="module")
def gguf(binary: Path) -> Path:
    return cmd.resolve_gguf("smollm2-135m-instruct", CACHE)


class Daemon:
    """prefixd in-process with managed llama backends; the cache folder is the test's."""

    def __init__(self, binary: Path, gguf: Path, cache: Path) -> None:
        self.binary, self.gguf, self.cache = binary, gguf, cache
        self.servers: list[Server] = []

    async def start(self, slots: int = 4, names: tuple[str, ...] = ("ls",),
                    **backend: Any) -> Server:
        backends = [{"name": n, "kind": "llama", "model": str(self.gguf), "models": [n],
                     "slots": slots, "context_window": 2048, "cache_bytes": 64 << 20,
                     "llama_args": ["-t", "2"], **backend} for n in names]
        settings = Settings(_env_file=None, backends=backends, llama_server=str(self.binary),
                            cache_dir=self.cache, disk_cache_bytes=1 << 30,
                            log_level="WARNING")
        server = Server(make_proxy(settings, build_backends(settings.backends, settings)))
        await server.start("127.0.0.1", 0)
        self.servers.append(server)
        return server

    async def stop(self, server: Server) -> None:
        self.servers.remove(server)
        await server.shutdown(10.0)


@pytest.fixture
async def daemon(binary: Path, gguf: Path, tmp_path: Path):
    d = Daemon(binary, gguf, tmp_path / "cache")
    try:
        yield d
    finally:
        for s in list(d.servers):
            await d.stop(s)


def backend(server: Server, name: str = "ls") -> LlamaBackend:
    b = server.proxy.backends[name]
    assert isinstance(b, LlamaBackend)
    return b


class Conversation:
    """An agent's conversation: a long system prompt of its own, tool output each turn."""

    def __init__(self, n: int, model: str = "ls", system_words: int = 120) -> None:
        rng = random.Random(n)
        self.model = model
        self.messages: list[dict] = [{"role": "system", "content": f"Agent {n}. " + " ".join(
            rng.choice(WORDS) for _ in range(system_words))}]
        self.n, self.turn = n, 0
        self.usage: list[dict] = []
        self.replies: list[str] = []

    def next_body(self) -> dict:
        rng = random.Random(self.n * 100 + self.turn)
        content = f"step {self.turn}: " + " ".join(rng.choice(WORDS) for _ in range(30))
        return {"model": self.model, "messages": [*self.messages,
                                                  {"role": "user", "content": content}],
                "max_tokens": 6, "temperature": 0}

    async def step(self, http: aiohttp.ClientSession, server: Server) -> dict:
        body = self.next_body()
        async with http.post(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                             json=body) as r:
            answer = await r.json()
            assert r.status == 200, answer
        reply = answer["choices"][0]["message"]["content"]
        self.messages = [*body["messages"], {"role": "assistant", "content": reply}]
        self.usage.append(answer["usage"])
        self.replies.append(reply)
        self.turn += 1
        return answer

    def cached(self, turn: int) -> int:
        return self.usage[turn]["prompt_tokens_details"]["cached_tokens"]

    def prompt(self, turn: int) -> int:
        return self.usage[turn]["prompt_tokens"]

    def completion(self, turn: int) -> int:
        return self.usage[turn]["completion_tokens"]


async def test_four_conversations_each_turn_in_the_slot_that_holds_it(daemon, http):
    """Four interleaved conversations with distinct long system prompts on four slots: from
    the second turn on, each reuses its whole previous prompt (and the reply), exactly as the
    keeper expected, with nothing saved or restored."""
    server = await daemon.start(slots=4)
    convs = [Conversation(n) for n in range(4)]
    for _ in range(3):
        for c in convs:
            await c.step(http, server)
    planner = server.proxy.router.planner("ls")
    assert planner is not None and planner.keeper is not None
    for c in convs:
        for t in (1, 2):       # the previous prompt and reply (the last token sampled only)
            assert c.cached(t) == c.prompt(t - 1) + c.completion(t - 1) - 1, (c.n, c.usage)
    assert planner.pins == {"fresh": 4, "holds_prefix": 8}
    exact = planner.status()["slot_exact"]
    assert exact["requests"] == 12, exact
    counts = planner.keeper.counts
    assert not any(k.startswith(("save", "restore_")) for k in counts), counts


async def test_more_conversations_than_slots_move_through_slot_files(daemon, http):
    """Four conversations on two slots: a slot is saved before another conversation takes
    it and restored when its own comes back, so every later turn still reuses its whole
    previous prompt; the replies are those of conversations that never left their slot; the
    moves show on /status and /metrics."""
    server = await daemon.start(slots=2)
    convs = [Conversation(n) for n in range(4)]
    for _ in range(3):
        for c in convs:
            await c.step(http, server)
    for c in convs:
        for t in (1, 2):
            assert c.cached(t) == c.prompt(t - 1) + c.completion(t - 1) - 1, (c.n, c.usage)
    keeper = backend(server).slot_keeper()
    assert keeper is not None
    assert keeper.counts["restore_hit"] == 8 and keeper.counts["save_saved"] >= 8
    # two of the conversations, each alone on a server of four slots: the same replies
    alone = await daemon.start(slots=4, names=("solo",))
    for c in convs[::3]:
        solo = Conversation(c.n, model="solo")
        for _ in range(3):
            await solo.step(http, alone)
        assert solo.replies == c.replies, c.n
    async with http.get(f"http://127.0.0.1:{server.port}/status") as r:
        status = next(b for b in (await r.json())["backends"] if b["name"] == "ls")
    assert status["kind"] == "llama" and status["slot_exact"]["requests"] == 12
    assert status["slot_files"]["files"] >= 2
    assert status["llama_slots"]["placements"]["restore"] == 8
    async with http.get(f"http://127.0.0.1:{server.port}/metrics") as r:
        text = await r.text()
    assert 'prefixd_llama_slot_restores_total{backend="ls",outcome="hit"} 8.0' in text
    assert 'prefixd_slot_decisions_total{backend="ls",reason="restore"} 8.0' in text


async def test_a_prefixd_restart_keeps_every_conversation(daemon, http):
    """prefixd stops (its llama-server's slots are saved first) and starts again: every
    conversation's next turn gets >= 90% of its prompt from the cache."""
    first = await daemon.start(slots=2)
    convs = [Conversation(n, system_words=400) for n in range(3)]
    for _ in range(2):
        for c in convs:
            await c.step(http, first)
    await daemon.stop(first)
    second = await daemon.start(slots=2)
    for c in convs:
        await c.step(http, second)
        assert c.cached(2) == c.prompt(1) + c.completion(1) - 1, (c.n, c.usage)
        assert c.cached(2) >= 0.9 * c.prompt(2), (c.n, c.usage)
    keeper = backend(second).slot_keeper()
    assert keeper is not None and keeper.counts["restore_hit"] == 3


async def test_a_damaged_slot_file_is_a_counted_miss_and_the_answer_is_right(daemon, http):
    """One slot, two conversations: A's slot is saved when B takes it. A's file is then
    damaged (same size, one byte of KV changed): A's next turn is computed, counted as a
    miss, and its reply is the reply of a server that never saw A before."""
    server = await daemon.start(slots=1)
    a, b = Conversation(1), Conversation(2)
    await a.step(http, server)
    await b.step(http, server)                 # A's slot saved into a file
    files = backend(server).files
    assert files is not None and len(files.files) == 1
    (only,) = files.files.values()
    path = files.dir / only.name
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x55
    path.write_bytes(bytes(raw))
    body = a.next_body()
    await a.step(http, server)
    assert a.cached(1) < a.prompt(0) // 2, a.usage          # computed again
    keeper = backend(server).slot_keeper()
    assert keeper is not None and keeper.counts["restore_damaged"] == 1
    assert files.counts["damaged"] == 1 and not path.exists()
    cold = await daemon.start(slots=1, names=("cold",))
    async with http.post(f"http://127.0.0.1:{cold.port}/v1/chat/completions",
                         json={**body, "model": "cold"}) as r:
        answer = await r.json()
    assert answer["choices"][0]["message"]["content"] == a.replies[1]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_sigkill_of_the_server_loses_no_request(daemon, http):
    """llama-server is SIGKILLed while it answers one request and two more wait in prefixd's
    queue: a new server process answers all three."""
    server = await daemon.start(slots=1)
    ls = backend(server)
    await Conversation(0).step(http, server)
    pid = ls.status().detail["pid"]
    convs = [Conversation(n) for n in range(1, 4)]
    for c in convs:
        c.messages[0]["content"] *= 3           # long prompts: the kill lands mid-request
    tasks = [asyncio.create_task(c.step(http, server)) for c in convs]
    async with asyncio.timeout(30):
        while server.proxy.queues["ls"].in_flight < 1:
            await asyncio.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    answers = await asyncio.gather(*tasks)
    assert len(answers) == 3 and all(a["choices"][0]["message"]["content"] for a in answers)
    assert ls.status().detail["pid"] not in (None, pid)
    assert ls.status().detail["restarts"] == 1


async def test_a_swapped_out_server_comes_back_warm(daemon, http):
    """Two models of one group are never loaded together: asking for the second stops the
    first (its slots saved first); asking for the first again starts it, and its
    conversation continues from the slot file."""
    server = await daemon.start(slots=2, names=("one", "two"), group="g")
    a, b = Conversation(1, model="one"), Conversation(2, model="two")
    await a.step(http, server)
    await b.step(http, server)
    one = backend(server, "one")
    assert not one.loaded and one.files is not None and len(one.files.files) == 1
    await a.step(http, server)
    assert a.cached(1) >= a.prompt(0), a.usage
    assert one.status().detail["llama_slots"]["placements"]["restore_hit"] == 1


async def test_a_shared_system_prompt_reaches_a_new_conversation_without_displacing_one(
        daemon, http):
    """Two conversations with one long system prompt on two slots: the second one's first turn
    gets the system prompt copied from the first one's slot (through a slot file) into the
    free slot, so the first one's next turn still finds its own slot whole."""
    server = await daemon.start(slots=2)
    a, b = Conversation(7), Conversation(8)
    b.messages[0] = dict(a.messages[0])
    await a.step(http, server)
    await b.step(http, server)
    await a.step(http, server)
    shared = a.prompt(0) - 40                       # the system prompt, short of the user turn
    assert b.cached(0) >= shared, b.usage
    assert a.cached(1) == a.prompt(0) + a.completion(0) - 1, a.usage
    planner = server.proxy.router.planner("ls")
    assert planner is not None and planner.pins == {"fresh": 1, "copy": 1, "holds_prefix": 1}


async def test_no_llama_server_outlives_a_killed_prefixd(binary, gguf, tmp_path, http):
    """`prefixd serve` is SIGKILLed (no shutdown runs): its llama-server goes too."""
    import json
    import sys
    import time

    from prefixd.backends.supervision.process import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    env.update({"PREFIXD_CACHE_DIR": str(tmp_path), "PREFIXD_LLAMA_SERVER": str(binary),
                "PREFIXD_BACKENDS": json.dumps([{"name": "ls", "kind": "llama",
                                                 "model": str(gguf), "slots": 1,
                                                 "context_window": 1024}])})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixd.proxy.cli", "serve", "--port", str(port), env=env,
        cwd=str(tmp_path), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)
    pid = None
    try:
        deadline = time.monotonic() + 60
        while pid is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            try:
                async with http.get(f"http://127.0.0.1:{port}/status") as r:
                    pid = (await r.json())["backends"][0].get("pid")
            except aiohttp.ClientError:
                continue
        assert pid is not None, "the llama-server never came up"
    finally:
        proc.kill()
        await proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        await asyncio.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"llama-server {pid} outlived its prefixd")
