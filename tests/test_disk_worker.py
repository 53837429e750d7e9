"""The disk tier across real worker processes: a worker killed with SIGKILL after the write
delay, or stopped with SIGTERM right after a turn, is followed by one that serves the next turn
from disk with the answer a cold worker gives; a process killed in the middle of writing
leaves nothing that loads wrong.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from test_worker_e2e import START_TIMEOUT_S, UNFED_TAIL, Worker, start_worker

SYSTEM = {"role": "system", "content": "You keep a cache on disk. " * 12}


async def chat(w: Worker, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model": "tiny", "messages": messages, "temperature": 0}
    async with aiohttp.ClientSession() as s, s.post(w.url + "/v1/chat/completions",
                                                    json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def disk_info(w: Worker) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(w.url + "/v1/cache") as resp:
        return (await resp.json())["disk"]


async def written(w: Worker, timeout: float = 60.0) -> dict[str, Any]:
    """The disk info once the idle turn's records are written (polled, with a deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        info = await disk_info(w)
        if info["records"] > 0 and info["pending_jobs"] == 0:
            return info
        assert time.monotonic() < deadline, info
        await asyncio.sleep(0.1)


def _start(model: Path, cache_dir: Path, **env: str) -> Worker:
    env = {"PREFIXD_CACHE_DIR": str(cache_dir), "PREFIXD_DISK_CACHE_BYTES": str(2**30),
           "PREFIXD_USE_SYSTEM_BLAS": "false", **env}
    w = start_worker(model, **env)
    w.log.wait_for("worker: serving", START_TIMEOUT_S)
    return w


async def _restart_case(model: Path, tmp_path: Path, stop: Callable[[Worker], None],
                        **env: str) -> None:
    first = _start(model, tmp_path / "cache", **env)
    try:
        messages = [SYSTEM, {"role": "user", "content": "Tell me about the river."}]
        one = await chat(first, messages)
        if "DISK_WRITE_DELAY" in "".join(env):
            await written(first)
        stop(first)
    finally:
        first.stop()
    messages += [{"role": "assistant", "content": one["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And the sea?"}]
    second = _start(model, tmp_path / "cache")
    cold = _start(model, tmp_path / "cold", PREFIXD_DISK_CACHE_BYTES="0", PREFIXD_CACHE_BYTES="0")
    try:
        warm, ref = await chat(second, messages), await chat(cold, messages)
        assert warm["choices"][0]["message"] == ref["choices"][0]["message"]
        whole_previous = one["usage"]["prompt_tokens"] + one["usage"]["completion_tokens"]
        cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert whole_previous - UNFED_TAIL <= cached < warm["usage"]["prompt_tokens"]
        assert warm["prefixd"]["cache"]["tier"] == "disk"
        assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        second.stop()
        cold.stop()


async def test_sigkill_after_the_write_delay_then_warm(tiny_model_dir: Callable[[str], Path],
                                                       tmp_path: Path) -> None:
    def kill(w: Worker) -> None:
        w.proc.send_signal(signal.SIGKILL)
        assert w.proc.wait(timeout=10) == -signal.SIGKILL

    await _restart_case(tiny_model_dir("qwen3_next"), tmp_path, kill,
                        PREFIXD_DISK_WRITE_DELAY="0.3")


async def test_sigterm_writes_everything_then_warm(tiny_model_dir: Callable[[str], Path],
                                                   tmp_path: Path) -> None:
    def term(w: Worker) -> None:            # long before the conversation counts as idle
        assert w.stop() == 0

    await _restart_case(tiny_model_dir("gemma3_text"), tmp_path, term)


WRITER = textwrap.dedent("""
    import random, sys
    from pathlib import Path
    from prefixd.backends.mlx.engine.tierglue import DiskSpec
    from prefixd.backends.mlx.engine.engine import Engine, EngineConfig, Turn
    from prefixd.backends.mlx.engine.pacing import Pacing, Plan
    from prefixd.backends.mlx.model.tiny import build_model
    import mlx.core as mx
    model = build_model("qwen3_5", seed=3)
    spec = DiskSpec(Path(sys.argv[1]), "crash-test", 1 << 30, 0.0, 64)
    engine = Engine(model, EngineConfig(checkpoint_interval=16, prefill_chunk=64), spec)
    for i in range(10_000):
        rng = random.Random(i)
        prompt = [rng.randrange(1, 1000) for _ in range(900)]
        turn = Turn(Pacing())
        engine.begin(prompt, sampler=lambda lp: mx.argmax(lp, axis=-1), max_tokens=2, turn=turn)
        for _ in engine.steps_of(turn, (), Plan(64)):
            pass
        engine.end(turn)
        engine.persist()
        print("wrote", i, flush=True)
""")


def test_sigkill_mid_write_leaves_nothing_that_loads(tmp_path: Path) -> None:
    """A process writing continuously is killed at random moments; every file the next start
    indexes must load as the state it claims (checked against a cold prefill), and the
    leftovers of the cut writes must be skipped and removed."""
    from test_disk_tier import _cold, _run, _same

    from prefixd.backends.mlx.engine.engine import Engine, EngineConfig
    from prefixd.backends.mlx.engine.tierglue import DiskSpec
    from prefixd.backends.mlx.model.tiny import build_model

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cut = []
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith("wrote")   # at least one job done
            deadline = time.monotonic() + 60
            while len(list(tmp_path.glob("*/records/*"))) < 10 * (1 + len(cut)) and \
                    time.monotonic() < deadline:
                time.sleep(0.01)                       # let some records land first, then
            while not list(tmp_path.glob("*/*/.*.tmp")) and time.monotonic() < deadline:
                pass                                   # kill as soon as a write is under way
        finally:
            proc.kill()
            proc.wait(timeout=30)
            if proc.stdout:
                proc.stdout.close()
        cut.append(len(list(tmp_path.glob("*/*/.*.tmp"))))
    assert sum(cut) > 0, "no kill landed in the middle of a write"
    model = build_model("qwen3_5", seed=3)
    spec = DiskSpec(tmp_path, "crash-test", 1 << 30, 0.0, 64)
    engine = Engine(model, EngineConfig(checkpoint_interval=16, prefill_chunk=64), spec)
    info = engine.cache_info()["disk"]
    assert info["skipped_files"].get("partial_write", 0) == cut[-1]
    assert not list(tmp_path.glob("*/*/.*.tmp"))
    assert info["records"] > 0, info
    engine.close(5)                     # one engine per directory at a time
    # Each conversation the writer finished or cut: its longest indexed state loads right.
    from_disk = 0
    for i in range(3):
        rng = random.Random(i)                           # the writer's conversation i
        prompt = [rng.randrange(1, 1000) for _ in range(900)] + [1, 2]
        fresh = Engine(model, EngineConfig(checkpoint_interval=16, prefill_chunk=64), spec)
        warm = _run(fresh, prompt)
        from_disk += warm[2].tier == "disk"
        _same(warm, _cold(model, prompt))
        fresh.close(5)
    assert from_disk > 0
    json.dumps(info)  # the info is plain JSON


async def test_damaged_files_after_a_restart_answer_cold_and_say_corrupt(
        tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """The adversarial case of issue 25 on real processes: a worker writes its cache at
    SIGTERM; 50 bytes of each record's tensor data are XORed and two layers of every block
    overwritten with random floats, token ids intact; the restarted worker answers what a cold
    worker answers, and says why it did not restore: `corrupt` in the response, /v1/cache and
    /metrics, and a warning line."""
    from test_disk_trust import _biggest, _rewrite, _span, _xor

    model = tiny_model_dir("falcon_h1")
    first = _start(model, tmp_path / "cache")
    try:
        messages = [SYSTEM, {"role": "user", "content": "Tell me about the river."}]
        one = await chat(first, messages)
        assert first.stop() == 0
    finally:
        first.stop()
    (key_dir,) = list((tmp_path / "cache" / "prompts").iterdir())
    rng, noise = random.Random(3), np.random.default_rng(3)
    for path in (key_dir / "records").iterdir():
        lo, hi = _span(path, _biggest(path))
        _xor(path, rng.sample(range(lo, hi), min(50, hi - lo)), rng)
    for path in (key_dir / "blocks").iterdir():
        _rewrite(path, lambda a: a.update({k: noise.standard_normal(a[k].shape).astype(
            a[k].dtype) for k in ("1.0", "3.1")}))
    messages += [{"role": "assistant", "content": one["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And the sea?"}]
    second = _start(model, tmp_path / "cache")
    cold = _start(model, tmp_path / "cold", PREFIXD_DISK_CACHE_BYTES="0", PREFIXD_CACHE_BYTES="0")
    try:
        warm, ref = await chat(second, messages), await chat(cold, messages)
        assert warm["choices"][0]["message"] == ref["choices"][0]["message"]
        assert warm["prefixd"]["cache"]["miss"] == "corrupt"
        info = await disk_info(second)
        assert info["misses"] == {"corrupt": 1} and info["skipped_files"]["corrupt"] >= 1
        async with aiohttp.ClientSession() as s, s.get(second.url + "/metrics") as resp:
            text = await resp.text()
        assert 'prefixd_worker_cache_misses_total{reason="corrupt"} 1.0' in text
        second.log.wait_for("did not load", 10)
        assert "corrupt" in second.log.seen[-1]
    finally:
        second.stop()
        cold.stop()
