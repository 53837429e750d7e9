"""`prefixd worker` processes for tests: started on a free loopback port, waited for, and
stopped by PID (terminate, then kill) whatever the test does."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(pair: bool = False) -> int:
    """A loopback port free now, below the kernel's ephemeral range, so no outgoing connection
    takes it before the server binds it (a port the kernel handed out as free is its next
    connection's local port as likely as anything: a kv-events endpoint lost to one); with
    `pair`, the port after it is free too (an endpoint and its replay)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10000, max(10001, low - 2))
        if _bindable(port) and (not pair or _bindable(port + 1)):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url: str, path: str, body: dict[str, Any], key: str,
              timeout: float = 120.0) -> dict[str, Any]:
    """POST `body` to a worker (its API key), the JSON it answers."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return dict(json.loads(r.read()))


def get_json(url: str, path: str, key: str, timeout: float = 30.0) -> dict[str, Any]:
    """GET a worker's JSON (its API key)."""
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return dict(json.loads(r.read()))


@contextmanager
def running_worker(model: Path, api_key: str, served: str = "tiny", port: int | None = None,
                   log: Path | None = None, ready_s: float = 120.0,
                   **env_extra: str) -> Iterator[str]:
    """A worker process serving `model` as `served` with a disk tier of its own (nothing from
    other runs), on `port` (a free one by default), its stderr to `log` (or nowhere); yields
    its base URL once healthy (within `ready_s`)."""
    port = port or free_port()
    err = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    cache = tempfile.TemporaryDirectory(prefix="prefixd-worker-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    env.update({"PREFIXD_USE_SYSTEM_BLAS": "false", "PREFIXD_CACHE_DIR": cache.name,
                **env_extra})
    proc = subprocess.Popen([sys.executable, "-m", "prefixd.backends.mlx", "--model",
                             str(model), "--served-name", served, "--port", str(port),
                             "--api-key", api_key], env=env,
                            stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert proc.poll() is None, "the worker exited"
            assert time.monotonic() < deadline, "the worker did not become healthy"
            time.sleep(0.2)
        yield url
    finally:
        stop(proc, 30.0)
        cache.cleanup()
        if log:
            err.close()


def stop(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """Terminate `proc` (by PID), kill it if it is still there after `grace` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
