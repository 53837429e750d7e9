"""A `prefixd worker` that serves other machines (issue 17 item 5): it needs an API key to
listen beyond loopback, and a proxy reaches it as a backend of kind `prefixd` with that key
(exact token offsets, its cache metrics), with no process management."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from worker_process import running_worker

from prefixd.backends.mlx.__main__ import is_loopback


def test_loopback_addresses():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.4.5", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.10", "example.org"))


def test_a_worker_refuses_a_non_loopback_address_without_a_key(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    # TEST-NET-1: never this machine's address, so nothing can be bound even if the check
    # were missing; the refusal must come first and say why.
    p = subprocess.run([sys.executable, "-m", "prefixd.backends.mlx", "--model", "m",
                        "--host", "192.0.2.1", "--port", "1"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "without an API key" in p.stderr


def test_a_worker_with_a_short_transfer_secret_exits_naming_it_not_echoing_it():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    env["PREFIXD_TRANSFER_SECRET"] = "tooshort-s3cret"
    p = subprocess.run([sys.executable, "-m", "prefixd.backends.mlx", "--model", "m",
                        "--port", "1"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "PREFIXD_TRANSFER_SECRET" in p.stderr
    assert "tooshort-s3cret" not in p.stderr and len(p.stderr.splitlines()) == 1


@pytest.fixture
def remote_worker(tiny_model_dir: Callable[[str], Path]):
    with running_worker(tiny_model_dir("qwen3"), "k3y") as url:
        yield url


async def test_proxy_over_a_remote_worker(remote_worker, start_proxy, http):
    proxy = await start_proxy(backends=[{"name": "far", "kind": "prefixd", "url": remote_worker,
                                         "api_key": "k3y", "models": ["tiny"]}])
    base = f"http://127.0.0.1:{proxy.port}"
    system = "You are terse. The time is 10:41:03. " + "Be brief. " * 30
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    async with http.post(base + "/v1/chat/completions", json=body) as r:
        assert r.status == 200 and r.headers["X-Prefixd-Backend"] == "far"
    body["messages"][0]["content"] = system.replace("10:41:03", "10:42:00")
    async with http.post(base + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        at = r.headers["X-Prefixd-Prefix"].split("at=")[1].split(";")[0]
    assert "@~" not in at                                   # exact, from its /tokenize
    async with http.get(base + "/metrics") as r:
        text = await r.text()
    assert 'prefixd_worker_cached_tokens_total{backend="far"}' in text
    async with http.get(remote_worker + "/v1/cache") as r:  # no key: refused
        assert r.status == 401


async def test_a_wrong_key_is_the_workers_401(remote_worker, start_proxy, http):
    proxy = await start_proxy(backends=[{"name": "far", "kind": "prefixd", "url": remote_worker,
                                         "api_key": "wrong", "models": ["tiny"]}])
    async with http.post(f"http://127.0.0.1:{proxy.port}/v1/chat/completions",
                         json={"model": "tiny", "messages": [
                             {"role": "user", "content": "hi"}]}) as r:
        assert r.status == 401
