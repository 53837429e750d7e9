"""A real `prefixd worker` process facing untrusted peers (issue 25): a forged prefix-state
bundle is refused before anything is stored, so the conversation it aimed at still answers
cold after a restart from the worker's disk tier; malformed HTTP on its port gets a JSON 400
and at most one log line, never a traceback (a managed worker's stderr is the proxy's log)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
from test_import_trust import Y, _forged
from worker_process import free_port, running_worker, stop

from prefixd.backends.mlx.server import seal

KEY = "k3y"
SECRET = "the transfer secret of this test"


async def _answer(http: aiohttp.ClientSession, base: str) -> tuple[str, int]:
    body = {"model": "tiny", "messages": Y, "temperature": 0, "max_tokens": 6}
    async with http.post(base + "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status == 200, await r.text()
        out = await r.json()
    return (out["choices"][0]["message"]["content"],
            out["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_a_forged_import_leaves_nothing_for_a_restart(
        tiny_model_dir: Callable[[str], Path], tmp_path: Path,
        http: aiohttp.ClientSession) -> None:
    model = tiny_model_dir("qwen3")
    auth = {"Authorization": f"Bearer {KEY}"}
    with running_worker(model, KEY, PREFIXD_TRANSFER_SECRET=SECRET) as source:
        cold = await _answer(http, source)
        async with http.post(source + "/v1/cache/export", headers=auth, json={
                "model": "tiny", "messages": Y}) as r:
            assert r.status == 200
            data, tag = await r.read(), r.headers.get(seal.HEADER)
    forged = _forged(data)
    # the target keeps its disk tier across the restart, and writes states at once
    target_env = {"PREFIXD_TRANSFER_SECRET": SECRET, "PREFIXD_CACHE_DIR": str(tmp_path),
                  "PREFIXD_DISK_WRITE_DELAY": "0"}
    with running_worker(model, KEY, **target_env) as target:
        for mac in (None, seal.sign("a secret guessed by the attacker", forged), tag):
            headers = {**auth, **({seal.HEADER: mac} if mac else {})}
            async with http.post(target + "/v1/cache/import", data=forged,
                                 headers=headers) as r:
                code = (await r.json())["error"]["code"]
                assert (r.status, code) == (403, "bad_mac" if mac else "unsigned_bundle")
    with running_worker(model, KEY, **target_env) as target:      # restarted from its disk
        assert await _answer(http, target) == (cold[0], 0)


# --- malformed HTTP -------------------------------------------------------------------------
MALFORMED = {
    "not HTTP": b"GARBAGE\r\n\r\n",
    "a TLS hello": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(32)),
    "a header without a colon": b"GET /health HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n",
    "a bad Content-Length": b"POST /v1/cache/import HTTP/1.1\r\nHost: x\r\n"
                            b"Content-Length: abc\r\n\r\n",
    "a request line too long": b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
}


@contextmanager
def _logged_worker(model: Path, log: Path) -> Iterator[int]:
    """A worker whose stderr (its log) goes to `log`; yields its port once healthy."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    env.update({"PREFIXD_USE_SYSTEM_BLAS": "false", "PREFIXD_CACHE_DIR": str(log.parent),
                "PREFIXD_DISK_CACHE_BYTES": "0"})
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "prefixd.backends.mlx", "--model",
                                 str(model), "--port", str(port), "--api-key", KEY], env=env,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield port
    finally:
        stop(proc, 30.0)


def _raw(port: int, request: bytes) -> tuple[int, Any]:
    """(status, JSON body) of the answer to raw bytes (the worker closes the connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def test_malformed_http_gets_a_json_400_and_one_log_line(
        tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    with _logged_worker(tiny_model_dir("qwen3"), log) as port:
        start = log.stat().st_size
        for why, request in MALFORMED.items():
            status, body = _raw(port, request)
            assert status == 400 and body["error"]["code"] == "bad_request", why
        logged = log.read_bytes()[start:].decode(errors="replace").splitlines()
        assert _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") \
            == (200, {"status": "ok"})                           # the worker serves on
    assert len(logged) == 1 and "malformed HTTP" in logged[0], logged   # one line for them all
    assert "Traceback" not in log.read_text()
