"""`prefixd demo`: the one-minute proof. Starts the daemon with two managed workers — a tiny
random-weight hybrid model (Qwen3-Next layout) and the built-in default model — plays a short
multi-turn agent conversation through it, and prints per turn: prompt tokens, cached tokens,
time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file from the workspace",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
SYSTEM = ("You are a careful coding agent working in a Python repository. Think step by step, "
          "call tools to read files before you change them, and keep answers short. ") * 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _turns() -> list[dict]:
    """Client turns: each is appended to the history, with the model's reply in between."""
    return [
        {"role": "user", "content": "The tests in tests/test_queue.py fail. Find out why."},
        {"role": "tool_result", "content": "def test_fifo():\n    assert order == [1, 2, 3]\n"},
        {"role": "user", "content": "Good. Now explain the fix in two sentences."},
        {"role": "user", "content": "Thanks. Is anything else in that file suspicious?"},
    ]


async def _turn(http: aiohttp.ClientSession, base: str, model: str, messages: list[dict]
                ) -> tuple[dict, float, str]:
    body = {"model": model, "messages": messages, "tools": TOOLS, "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 24, "temperature": 0}
    usage: dict[str, Any] = {}
    t0, ttft, text = time.monotonic(), None, []
    async with http.post(base + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            for ch in event.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    text.append(piece)
            usage = event.get("usage") or usage
    return usage, ttft if ttft is not None else time.monotonic() - t0, "".join(text)


async def _conversation(base: str, model: str) -> list[tuple[int, int, int, float]]:
    rows = []
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for i, turn in enumerate(_turns(), 1):
            if turn["role"] == "tool_result":   # the model "called" read_file; answer it
                messages.append({"role": "assistant", "content": "", "tool_calls": [
                    {"id": f"call_{i}", "type": "function", "function": {
                        "name": "read_file", "arguments": '{"path": "tests/test_queue.py"}'}}]})
                messages.append({"role": "tool", "tool_call_id": f"call_{i}",
                                 "content": turn["content"]})
            else:
                messages.append(turn)
            usage, ttft, reply = await _turn(http, base, model, messages)
            messages.append({"role": "assistant", "content": reply})
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            rows.append((i, usage.get("prompt_tokens", 0), cached, ttft))
    return rows


async def _wait_ready(base: str, proc: subprocess.Popen, deadline_s: float) -> None:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - t0 < deadline_s:
            if proc.poll() is not None:
                raise RuntimeError(f"prefixd exited with status {proc.returncode}")
            try:
                async with http.get(base + "/status") as r:
                    states = [b["state"] for b in (await r.json())["backends"]]
                    if "failed" in states:
                        raise RuntimeError(f"a worker failed to start: {await r.text()}")
                    if states and all(s == "ready" for s in states):
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError("workers did not become ready in time")


def _print(model: str, rows: list[tuple[int, int, int, float]]) -> None:
    print(f"\n{model}")
    print(f"{'turn':>4} {'prompt tok':>10} {'cached tok':>10} {'reused':>7} {'TTFT ms':>8}")
    for turn, prompt, cached, ttft in rows:
        share = f"{100 * cached / prompt:.0f}%" if prompt else "-"
        print(f"{turn:>4} {prompt:>10} {cached:>10} {share:>7} {ttft * 1000:>8.0f}")


async def _run(args: argparse.Namespace) -> int:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="prefixd-demo-"))
    tiny = work / "tiny-qwen3-next"
    if not (tiny / "config.json").exists():
        subprocess.run([sys.executable, "-m", "prefixd.proxy.cli", "tiny-model", "qwen3_next",
                        str(tiny)], check=True, stdout=subprocess.DEVNULL)
    backends: list[dict[str, Any]] = [{"name": "tiny-hybrid", "kind": "mlx", "model": str(tiny),
                 "models": ["tiny-qwen3-next"]}]
    if not args.no_default:
        backends.append({"name": "default", "kind": "mlx", "model": "smollm2-135m-instruct"})
    port = _free_port()
    env = {**os.environ, "PREFIXD_BACKENDS": json.dumps(backends),
           "PREFIXD_LOG_LEVEL": "WARNING",
           "PREFIXD_PARENT_PID": str(os.getpid())}   # the daemon exits if the demo is killed
    print(f"prefixd demo: starting the daemon on 127.0.0.1:{port} "
          f"({', '.join(b['name'] for b in backends)}) ...", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "prefixd.proxy.cli", "serve", "--port",
                             str(port)], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        await _wait_ready(base, proc, args.timeout)
        for model in ["tiny-qwen3-next"] + ([] if args.no_default
                                            else ["smollm2-135m-instruct"]):
            _print(model, await _conversation(base, model))
        print("\ncached tok: prompt tokens the worker restored from its checkpointed cache "
              "instead of recomputing;\nfrom turn 2 on only the newest messages are prefilled. "
              "Run `prefixd serve` and watch /metrics and /debug/prefix for your own traffic.")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prefixd demo", description=__doc__)
    ap.add_argument("--no-default", action="store_true",
                    help="only the tiny hybrid model (no default-model download)")
    ap.add_argument("--workdir", help="where the tiny model is written (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for workers")
    try:
        return asyncio.run(_run(ap.parse_args(argv)))
    except KeyboardInterrupt:
        return 130
