"""A fake OpenAI-compatible upstream on a loopback port: the outer boundary of the proxy tests.

Behaviour per request comes from an unknown body field the proxy passes through:
`"fake": {"chunks": N, "delay": s, "status": code, "hold": true, "usage": {...}}`, or a
scripted broken upstream: `"raw": [str, ...]` (written as-is, in that many writes, with
`"content_type"`), then `"drop": true` (abort the connection instead of ending the body);
`"hang_headers": true` (never answer).
It records every request it received, in order, its maximum concurrency, and when a
stream was abandoned by its client (the proxy closing the upstream connection).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web


class FakeUpstream:
    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.active = 0
        self.max_active = 0
        self.aborted_at: list[float] = []
        self.finished = 0
        self.release = asyncio.Event()          # "hold" requests wait for it
        self.paths: list[str] = []              # every request's path, routed or not
        self.arrived = asyncio.Condition()      # notified on every request arrival
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        @web.middleware
        async def record(request: web.Request, handler):  # type: ignore[no-untyped-def]
            self.paths.append(request.path)
            return await handler(request)

        app = web.Application(middlewares=[record])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def wait_received(self, n: int, timeout: float = 10.0) -> None:
        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(lambda: len(self.received) >= n),
                                   timeout)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        async with self.arrived:
            self.received.append(body)
            self.arrived.notify_all()
        fake = body.get("fake") or {}
        if fake.get("hang_headers"):
            await asyncio.Event().wait()
        if "raw" in fake:
            return await self._raw(request, fake)
        status = fake.get("status", 200)
        if status != 200:
            return web.json_response({"error": {"message": f"fake failure {status}",
                                                "type": "fake", "param": None, "code": None}},
                                     status=status)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if fake.get("hold"):
                await self.release.wait()
            if body.get("stream"):
                return await self._stream(request, body, fake)
            await asyncio.sleep(fake.get("delay", 0))
            return web.json_response(_completion(body, fake))
        except asyncio.CancelledError:
            self.aborted_at.append(time.monotonic())
            raise
        finally:
            self.active -= 1
            self.finished += 1

    async def _raw(self, request: web.Request, fake: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": fake.get("content_type",
                                                                    "text/event-stream")})
        await resp.prepare(request)
        for i, part in enumerate(fake["raw"]):
            await resp.write(part.encode())
            if i == 0 and fake.get("hold_after_first"):
                await self.release.wait()
        if fake.get("drop"):
            assert request.transport is not None
            request.transport.abort()
            return resp
        await resp.write_eof()
        return resp

    async def _stream(self, request: web.Request, body: dict, fake: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n, delay = fake.get("chunks", 3), fake.get("delay", 0)
        for i in range(n):
            chunk = {"id": "c1", "object": "chat.completion.chunk", "model": body.get("model"),
                     "choices": [{"index": 0, "delta": {"content": f"tok{i} "}}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if i == 0 and fake.get("hold_after_first"):
                await self.release.wait()
            if delay:
                await asyncio.sleep(delay)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "c1", "object": "chat.completion.chunk", "choices": [],
                     "usage": _usage(fake, n)}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _usage(fake: dict, completion: int) -> dict[str, Any]:
    u = fake.get("usage") or {}
    return {"prompt_tokens": u.get("prompt_tokens", 10), "completion_tokens": completion,
            "total_tokens": u.get("prompt_tokens", 10) + completion,
            "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 4)}}


def _completion(body: dict, fake: dict) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion", "model": body.get("model"),
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "hello"}}],
            "usage": _usage(fake, 1), "echo": body}
