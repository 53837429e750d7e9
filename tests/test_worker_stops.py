"""A real worker stopped mid-answer, through the proxy (issue 25 item 1): the answer is reported
cut short in each client API's own way, however the worker was stopped — SIGTERM and SIGINT
(it ends its stream with an error event), SIGSTOP until its supervisor gives up on it and then
SIGCONT (the supervisor's SIGTERM reaches it then) — and the worker comes back. SIGKILL is
`test_managed_proxy.py::test_kill_9_mid_stream_while_five_wait`; every wire shape of a stop,
per API, is `test_cut_short.py`."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from test_cut_short import APIS, assert_cut_short, sse_events
from tokenizers import Tokenizer

from prefixd.backends.managed import ManagedBackend
from prefixd.backends.supervision.states import ProcState
from prefixd.proxy.server import Server, make_proxy
from prefixd.proxy.settings import Settings

pytestmark = pytest.mark.slow


class Served:
    def __init__(self, server: Server, backend: ManagedBackend, eos: list[int]) -> None:
        self.server, self.backend, self.eos = server, backend, eos

    @property
    def pid(self) -> int:
        return self.backend.status().detail["pid"]

    async def ready_again(self, old_pid: int, timeout: float = 120.0) -> None:
        """Until a new worker (another PID) is ready."""
        deadline = time.monotonic() + timeout
        while True:
            await self.backend.wait_for(ProcState.READY, timeout=deadline - time.monotonic())
            if self.pid not in (None, old_pid):
                return
            await asyncio.sleep(0.1)     # the supervisor has not seen the exit yet
            assert time.monotonic() < deadline

    def body(self, api: str) -> tuple[str, dict]:
        """A long answer: the end-of-text tokens banned, so it runs until stopped."""
        path, body = APIS[api]
        bias = {str(t): -100 for t in self.eos}
        limit = {"max_output_tokens": 3000} if api == "responses" else {"max_tokens": 3000}
        extra = {} if api == "messages" else {"logit_bias": bias}
        return path, {**body, "model": "tiny", **limit, **extra}


@pytest.fixture
async def served(tiny_model_dir: Callable[[str], Path]) -> AsyncIterator[Served]:
    model = tiny_model_dir("qwen3")
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    eos = [i for t in ("<|im_end|>", "<|endoftext|>") if (i := tok.token_to_id(t)) is not None]
    settings = Settings(_env_file=None, backends=[
        {"name": "tiny", "kind": "mlx", "model": str(model), "models": ["tiny"],
         "health_interval_s": 0.1,      # a frozen worker is given up on in 3 probes of 1 s
         "startup_probe_max_s": 0.05}])     # a (re)start is seen ready within 50 ms
    backend = ManagedBackend(settings.backends[0], settings, stop_grace_s=30.0,
                             backoff_s=(0.05, 0.1))     # restarts in a row: 0.35 s, not 2.4
    server = Server(make_proxy(settings, [backend]))
    await server.start("127.0.0.1", 0)
    try:
        await backend.wait_for(ProcState.READY, timeout=120)
        yield Served(server, backend, eos)
    finally:
        await server.shutdown(5.0)


DELTA = {"chat": b'"delta": {"content": "', "messages": b'"text_delta"',
         "responses": b"response.output_text.delta"}


async def stop_mid_answer(http: aiohttp.ClientSession, served: Served, api: str,
                          stop: Callable[[int], object]) -> bytes:
    """Stream a long answer; after its third content event, `stop(worker_pid)`; the rest."""
    path, body = served.body(api)
    pid = served.pid
    async with http.post(f"http://127.0.0.1:{served.server.port}{path}", json=body) as r:
        assert r.status == 200
        got = b""
        while got.count(DELTA[api]) < 3:
            chunk = await asyncio.wait_for(r.content.readany(), 60)
            assert chunk, got
            got += chunk
        stopping = stop(pid)
        if asyncio.iscoroutine(stopping):
            await stopping
        got += await asyncio.wait_for(r.read(), 120)
    await served.ready_again(pid)
    return got


async def test_a_worker_stopped_by_a_signal_cuts_every_api_short(served, http):
    stops = [(api, signal.SIGTERM) for api in sorted(APIS)] + [("chat", signal.SIGINT)]
    for api, sig in stops:
        raw = await stop_mid_answer(http, served, api, lambda pid, sig=sig: os.kill(pid, sig))
        assert_cut_short(api, sse_events(raw))


async def test_a_stopped_worker_the_supervisor_gave_up_on_cuts_the_answer_short(served, http):
    backend = served.backend

    async def freeze_until_given_up(pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        try:
            await backend.wait_for(ProcState.STOPPING, timeout=60)   # it sent SIGTERM
        finally:
            os.kill(pid, signal.SIGCONT)

    raw = await stop_mid_answer(http, served, "messages", freeze_until_given_up)
    assert_cut_short("messages", sse_events(raw))
