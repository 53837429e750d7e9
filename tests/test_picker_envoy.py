"""`prefixd picker` behind a real Envoy (deploy/envoy/, tests/envoy_fixtures.py), what the
harness tests (tests/test_envoy_harness.py: the pick routes, large bodies, streams, FailClose /
FailOpen) leave: the data plane's subset hint, 503 and 429 reaching the client in its API's
error shape, a conversation following the endpoint that served it in each client API (the
picker learning from answers that pass through Envoy), and the `prefixd picker` command
itself: gRPC health for every name, a pick through Envoy, SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from envoy_fixtures import *  # noqa: F403  (its fixtures: start_envoy, stand_ins, pickers)
from envoy_fixtures import SERVED_BY, Envoy, Pickers, StandIn, StartEnvoy, free_port

grpc = pytest.importorskip("grpc")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

TIMEOUT = aiohttp.ClientTimeout(total=30)
SUBSET = "x-test-subset-hint"     # the header our Envoy config turns into the subset hint


async def post(envoy: Envoy, body: dict, path: str = "/v1/chat/completions",
               **headers: str) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, \
            s.post(envoy.url + path, json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


def chat(user: str, history: list[dict] | None = None, **extra: object) -> dict:
    return {"model": "fake", "messages": [
        {"role": "system", "content": "You are a careful coding agent. " * 30},
        *(history or []), {"role": "user", "content": user}], **extra}


async def test_the_subset_hint_restricts_the_pick(start_envoy: StartEnvoy,
                                                  stand_ins: list[StandIn], pickers: Pickers):
    pool = [s.address for s in stand_ins]
    envoy = await start_envoy(await pickers.start(pool), pool, subset_header=SUBSET)
    for allowed in stand_ins:
        status, headers, _ = await post(envoy, chat("Which module parses tokens?"),
                                        **{SUBSET: allowed.address})
        assert status == 200 and headers[SERVED_BY] == allowed.address
        assert allowed.received[-1][1]["x-gateway-destination-endpoint"] == allowed.address
    status, _, body = await post(envoy, chat("again"), **{SUBSET: "10.1.2.3:8000"})
    assert status == 503
    assert json.loads(body)["error"]["code"] == "no_endpoint"


async def test_every_endpoint_full_is_429_in_the_client_apis_shape(
        start_envoy: StartEnvoy, stand_ins: list[StandIn], pickers: Pickers,
        tmp_path: Path):
    """One endpoint running one request at most, none queued: while a stream is held there,
    the next request is shed with 429 (an Anthropic client gets Anthropic's error shape);
    once it ended, the next is served."""
    file = tmp_path / "endpoints.json"
    one = stand_ins[0]
    file.write_text(json.dumps([{"address": one.address, "models": ["fake"],
                                 "max_concurrency": 1, "queue_depth": 0}]))
    envoy = await start_envoy(await pickers.start([], picker_endpoints_file=file),
                              [one.address])
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, \
            s.post(envoy.url + "/v1/chat/completions", json=chat("long", stream=True),
                   headers={"x-stand-in-hold": "1"}) as held:
        assert held.status == 200
        await asyncio.wait_for(held.content.readuntil(b"\n\n"), 10)
        status, _, body = await post(envoy, {"model": "fake", "max_tokens": 8, "messages": [
            {"role": "user", "content": "short"}]}, path="/v1/messages")
        assert status == 429
        shape = json.loads(body)
        assert shape["type"] == "error" and shape["error"]["type"] == "rate_limit_error"
        one.release.set()
        await held.read()
    status, headers, _ = await post(envoy, chat("short"))
    assert status == 200 and headers[SERVED_BY] == one.address


CONVERSATIONS = {
    "/v1/chat/completions": lambda turn: chat(*turn),
    "/v1/messages": lambda turn: {
        "model": "fake", "max_tokens": 16, "system": "You are a careful coding agent. " * 30,
        "messages": [*(turn[1] or []), {"role": "user", "content": turn[0]}]},
    "/v1/responses": lambda turn: {
        "model": "fake", "instructions": "You are a careful coding agent. " * 30,
        "input": [*(turn[1] or []), {"role": "user", "content": turn[0]}]},
}


@pytest.mark.parametrize("path", list(CONVERSATIONS))
@pytest.mark.parametrize("stream", [False, True])
async def test_a_conversation_follows_the_endpoint_that_served_it(
        path: str, stream: bool, start_envoy: StartEnvoy, stand_ins: list[StandIn],
        pickers: Pickers):
    """Turn 1 goes where the selection hook sends it, each time to another endpoint; turn 2
    (no hook) follows it there: the picker learned from the answer that came back through
    Envoy."""
    pool = [s.address for s in stand_ins]
    envoy = await start_envoy(await pickers.start(pool), pool)
    for n, target in enumerate(stand_ins):
        first = f"Conversation {n}: fix the failing test in parser.py."
        body = CONVERSATIONS[path]((first, None)) | ({"stream": True} if stream else {})
        status, headers, _ = await post(envoy, body, path=path, **{
            "test-epp-endpoint-selection": target.host})
        assert status == 200 and headers[SERVED_BY] == target.address
        history = [{"role": "user", "content": first},
                   {"role": "assistant", "content": f"served by {target.address}"}]
        body = CONVERSATIONS[path](("Run it again.", history)) | \
            ({"stream": True} if stream else {})
        status, headers, _ = await post(envoy, body, path=path)
        assert status == 200 and headers[SERVED_BY] == target.address, n


async def test_the_picker_command_serves_health_picks_and_stops_on_sigterm(
        start_envoy: StartEnvoy, stand_ins: list[StandIn], tmp_path: Path):
    port = free_port()
    file = tmp_path / "endpoints.json"
    file.write_text(json.dumps({"endpoints": [{"address": s.address} for s in stand_ins]}))
    env_file = tmp_path / "picker.env"
    env_file.write_text("PREFIXD_LOG_LEVEL=INFO\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    proc = subprocess.Popen([sys.executable, "-m", "prefixd.proxy.cli", "picker", "--env-file",
                             str(env_file), "--port", str(port), "--endpoints", str(file)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", "liveness", "readiness",
                         "envoy.service.ext_proc.v3.ExternalProcessor"):
                got = await health.Check(health_pb2.HealthCheckRequest(service=name))
                assert got.status == health_pb2.HealthCheckResponse.SERVING, name
        envoy = await start_envoy(f"127.0.0.1:{port}", [s.address for s in stand_ins])
        # the endpoints file names no models: they come from each endpoint's /v1/models
        status, headers, _ = await post(envoy, chat("hello"))
        assert status == 200 and headers[SERVED_BY] in {s.address for s in stand_ins}
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        assert proc.stdout is not None
        with proc.stdout:
            log = proc.stdout.read().decode(errors="replace")
    assert "picker: ext_proc and gRPC health on" in log
