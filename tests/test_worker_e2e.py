"""The real worker process (`python -m prefixd.backends.mlx`) on the tiny hybrid `qwen3_next`
model: a multi-turn chat reuses the whole previous conversation, warm answers equal cold ones,
SIGTERM mid-stream exits promptly, and a worker whose parent is SIGKILLed does not linger."""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
import pytest
from worker_process import free_port

START_TIMEOUT_S = 60.0
# Why at most this many tokens of the previous turn are recomputed: the tiny models emit only
# whole-word tokens that re-encode to themselves and the template re-renders the assistant reply
# verbatim after the same `<|im_start|>assistant\n`, so the new prompt extends the previous
# prompt + reply exactly. Only the reply's last sampled token was never fed through the model
# (nothing came after it), so it is not in the cached state.
UNFED_TAIL = 1


class Lines:
    """A child's stderr, pumped by a thread so that waiting for a line can have a deadline."""

    def __init__(self, stream: IO[str]) -> None:
        self.seen: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self._stream = stream
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in self._stream:
            self._q.put(line)
        self._q.put(None)

    def close(self) -> None:
        """After the writer(s) exited: the pump reaches EOF, then the pipe is closed."""
        self._thread.join(timeout=10)
        self._stream.close()

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                seen = "".join(self.seen)
                raise AssertionError(f"no {text!r} within {timeout}s: {seen}") from None
            if line is None:
                raise AssertionError(f"exited before {text!r}: {''.join(self.seen)}")
            self.seen.append(line)
            if text in line:
                return



@dataclass
class Worker:
    proc: subprocess.Popen[str]
    url: str
    log: Lines
    headers: dict[str, str]  # Authorization, when started with PREFIXD_WORKER_TOKEN

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self.log.close()


def start_worker(model: Path, **env: str) -> Worker:
    port = free_port()
    full_env = {**os.environ, "PREFIXD_PARENT_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1",
                "PREFIXD_MAX_TOKENS_DEFAULT": "12", **env}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixd.backends.mlx", "--model", str(model),
         "--served-name", "tiny", "--host", "127.0.0.1", "--port", str(port)],
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=full_env)
    assert proc.stderr is not None
    token = env.get("PREFIXD_WORKER_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return Worker(proc, f"http://127.0.0.1:{port}", Lines(proc.stderr), headers)


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Callable[[str], Path]) -> Iterator[tuple[Worker, Worker]]:
    """(warm, cold): the same model with the default cache budget and with a budget of 0 (and a
    per-start token)."""
    model = tiny_model_dir("qwen3_next")
    started = [start_worker(model), start_worker(model, PREFIXD_CACHE_BYTES="0",
                                                 PREFIXD_WORKER_TOKEN="cold-secret")]
    try:
        for w in started:  # loading in parallel
            w.log.wait_for("worker: serving", START_TIMEOUT_S)
        yield started[0], started[1]
    finally:
        codes = [w.stop() for w in started]
    assert codes == [0, 0]


async def ask(w: Worker, messages: list[dict[str, Any]], stream: bool = False) -> dict[str, Any]:
    """One greedy chat turn; for a stream, the joined text and the include_usage chunk."""
    body = {"model": "tiny", "messages": messages, "temperature": 0, "stream": stream,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(headers=w.headers) as s, s.post(
            w.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            out = await resp.json()
            return {"text": out["choices"][0]["message"]["content"], "usage": out["usage"]}
        text, usage = [], None
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                text += [c["delta"].get("content") or "" for c in chunk["choices"]]
        return {"text": "".join(text), "usage": usage}


async def test_multi_turn_chat_reuses_the_conversation(workers: tuple[Worker, Worker]) -> None:
    warm, cold = workers
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a model with a prefix cache. " * 8},
        {"role": "user", "content": "Tell me about the river and the sea."}]
    prev: dict[str, int] | None = None
    for turn in range(4):
        hot = await ask(warm, messages, stream=turn == 3)
        ref = await ask(cold, messages)
        assert hot["text"] == ref["text"]  # warm == cold, greedy
        assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        usage = hot["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if prev is not None:
            whole_previous = prev["prompt_tokens"] + prev["completion_tokens"]
            assert whole_previous - UNFED_TAIL <= cached < usage["prompt_tokens"], (turn, usage)
        prev = usage
        messages += [{"role": "assistant", "content": hot["text"]},
                     {"role": "user", "content": f"Turn {turn + 2}: and the city?"}]


async def test_a_worker_started_with_a_token_requires_it(workers: tuple[Worker, Worker]) -> None:
    _, cold = workers
    async with aiohttp.ClientSession() as s:
        async with s.get(cold.url + "/health") as resp:
            assert resp.status == 200
        async with s.get(cold.url + "/v1/models") as resp:
            assert resp.status == 401
        async with s.get(cold.url + "/v1/models", headers=cold.headers) as resp:
            assert resp.status == 200


async def test_sigterm_mid_stream_exits_promptly(tiny_model_dir: Callable[[str], Path]) -> None:
    w = start_worker(tiny_model_dir("qwen3_next"), PREFIXD_USE_SYSTEM_BLAS="false")
    try:
        w.log.wait_for("worker: serving", START_TIMEOUT_S)
        body = {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 4000,
                "stream": True}
        async with aiohttp.ClientSession() as s, s.post(w.url + "/v1/chat/completions",
                                                        json=body) as resp:
            async for line in resp.content:
                if b'"content": " ' in line:
                    break
            t0 = time.monotonic()
            w.proc.send_signal(signal.SIGTERM)
            rest = await resp.content.read()
        assert w.proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 3.0
        assert b"[DONE]" not in rest  # the stream was cut, and said so
        assert b'"error"' in rest
    finally:
        w.stop()


def test_unloadable_model_exits_1(tmp_path: Path) -> None:
    w = start_worker(tmp_path / "missing", PREFIXD_USE_SYSTEM_BLAS="false")
    try:
        w.log.wait_for("cannot load model", START_TIMEOUT_S)
        assert w.proc.wait(timeout=10) == 1
    finally:
        w.stop()


PARENT = """
import os, subprocess, sys
env = {**os.environ, "PREFIXD_PARENT_PID": str(os.getpid())}
child = subprocess.Popen([sys.executable, "-m", "prefixd.backends.mlx", "--model", sys.argv[1],
                          "--port", sys.argv[2]], env=env)
print(child.pid, flush=True)
child.wait()
"""


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux)")
def test_worker_exits_when_its_parent_is_killed(tiny_model_dir: Callable[[str], Path]) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFIXD_USE_SYSTEM_BLAS": "false"}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tiny_model_dir("qwen3_next")), str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert parent.stdout is not None and parent.stderr is not None
    worker_pid = int(parent.stdout.readline())
    pidfd = os.pidfd_open(worker_pid)
    log = Lines(parent.stderr)
    try:
        log.wait_for("worker: listening", START_TIMEOUT_S)
        parent.kill()
        parent.wait()
        readable, _, _ = select.select([pidfd], [], [], 10.0)  # readable once the worker exits
        assert readable, "the worker outlived its SIGKILLed parent"
    finally:
        if not select.select([pidfd], [], [], 0)[0]:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        os.close(pidfd)
        parent.kill()
        parent.wait()
        parent.stdout.close()
        log.close()
