"""`prefixd serve` with nothing configured: one managed worker on the built-in default model
(SmolLM2-135M-Instruct from a PyPI package's GGUF), answering through the proxy; SIGTERM
stops the daemon and its worker (no orphan)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from prefixd.backends.mlx.model.provision import BUILTIN_MODELS, config_window
from prefixd.backends.supervision.process import free_port

CACHE = Path(os.environ.get("PREFIXD_TEST_CACHE_DIR", "~/.cache/prefixd-test")).expanduser()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.network
async def test_default_model_answers_through_the_daemon(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    env["PREFIXD_CACHE_DIR"] = str(CACHE)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixd.proxy.cli", "serve", "--port", str(port), env=env,
        cwd=str(tmp_path), stderr=asyncio.subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    worker_pid = None
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            async with asyncio.timeout(300):          # first run downloads + converts
                while True:
                    try:
                        async with http.get(base + "/ready") as r:
                            if r.status == 200:
                                break
                            states = str(await r.json())
                            assert "failed" not in states, states
                    except aiohttp.ClientConnectionError:
                        pass
                    await asyncio.sleep(0.25)
            async with http.get(base + "/status") as r:
                backend = (await r.json())["backends"][0]
            assert backend["kind"] == "mlx" and backend["models"] == ["smollm2-135m-instruct"]
            worker_pid = backend["pid"]
            body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "temperature": 0, "max_tokens": 20}
            async with http.post(base + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                answer = await r.json()
        assert answer["choices"][0]["message"]["content"] == "The capital of France is Paris."
        assert answer["model"] == "smollm2-135m-instruct"
        # the window known before any load (the table) is the one its GGUF gives the model
        converted = json.loads((CACHE / "models" / "smollm2-135m-instruct" / "config.json")
                               .read_text())
        window = BUILTIN_MODELS["smollm2-135m-instruct"].context_window
        assert converted["max_position_embeddings"] == window
        assert config_window("smollm2-135m-instruct", CACHE) == window
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert worker_pid is not None and _gone(worker_pid)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if worker_pid is not None and not _gone(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)
