"""A fake OpenAI-compatible upstream on a loopback port: the outer boundary of the proxy tests.

Behaviour per request comes from an unknown body field the proxy passes through:
`"fake": {"chunks": N, "delay": s, "status": code, "error": {...}, "hold": true, "usage": {...}}`,
or a
scripted broken upstream: `"raw": [str, ...]` (written as-is, in that many writes, with
`"content_type"`), then `"drop": true` (abort the connection instead of ending the body);
`"hang_headers": true` (never answer).
Clients whose bodies prefixd rebuilds (the Anthropic and Responses APIs, real agents) cannot
carry `fake`: a request without it takes the next spec from `scripted` (a FIFO the test fills),
else asks `responder(body)` (a callable returning a spec or None). A spec may also hold
`"reply": {"content", "reasoning", "tool_calls": [{"id", "name", "arguments"}], "finish_reason"}`:
the answer as a chat.completion, or streamed with each text and each tool call's arguments
split across several chunks (`"piece": n` characters, default 5), then usage when asked.
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
    def __init__(self, tokenizes: bool = False) -> None:
        self.tokenizes = tokenizes              # answer /apply-template and /tokenize
        self.templated: list[dict[str, Any]] = []   # bodies sent to /apply-template
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
        self.scripted: list[dict[str, Any]] = []    # specs for requests without "fake"
        self.responder: Any = None                  # body -> spec | None, after `scripted`

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
        if self.tokenizes:
            app.router.add_post("/apply-template", self._apply_template)
            app.router.add_post("/tokenize", self._tokenize)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port or 0)  # a restart: same port
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def kill(self) -> None:
        """As a killed server: stop listening and reset every open connection now, requests
        in progress unanswered (`stop` lets them finish)."""
        if self.runner is None:
            return
        for site in list(self.runner.sites):
            await site.stop()
        server = self.runner.server
        for conn in list(server.connections if server is not None else []):
            if conn.transport is not None:
                conn.transport.abort()
        await self.runner.cleanup()

    async def wait_received(self, n: int, timeout: float = 10.0) -> None:
        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(lambda: len(self.received) >= n),
                                   timeout)

    async def _apply_template(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.templated.append(body)
        return web.json_response({"prompt": json.dumps(body.get("messages"))})

    async def _tokenize(self, request: web.Request) -> web.Response:
        text = (await request.json()).get("content", "")
        return web.json_response({"tokens": [ord(c) for c in text]})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        async with self.arrived:
            self.received.append(body)
            self.arrived.notify_all()
        fake = body.get("fake") or self._script(body)
        if fake.get("hang_headers"):
            await asyncio.Event().wait()
        if "raw" in fake:
            return await self._raw(request, fake)
        status = fake.get("status", 200)
        if status != 200:
            return web.json_response({"error": fake.get("error") or {
                "message": f"fake failure {status}", "type": "fake", "param": None,
                "code": None}}, status=status)
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

    def _script(self, body: dict) -> dict[str, Any]:
        if self.scripted:
            return self.scripted.pop(0)
        if self.responder is not None:
            return self.responder(body) or {}
        return {}

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
        if "reply" in fake:
            return await self._stream_reply(resp, body, fake)
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

    async def _stream_reply(self, resp: web.StreamResponse, body: dict,
                            fake: dict) -> web.StreamResponse:
        chunks = reply_chunks(fake["reply"], body.get("model"), fake.get("piece", 5))
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({"id": "c1", "object": "chat.completion.chunk", "choices": [],
                           "usage": _usage(fake, len(chunks))})
        for chunk in chunks:
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if fake.get("delay"):
                await asyncio.sleep(fake["delay"])
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _pieces(text: str, n: int) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)] or [""]


def reply_message(reply: dict) -> dict[str, Any]:
    """A scripted reply as a chat.completion message."""
    msg: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
    if reply.get("reasoning"):
        msg["reasoning_content"] = reply["reasoning"]
    if reply.get("tool_calls"):
        msg["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for c in reply["tool_calls"]]
    return msg


def _finish(reply: dict) -> str:
    return reply.get("finish_reason") or ("tool_calls" if reply.get("tool_calls") else "stop")


def reply_chunks(reply: dict, model: Any, piece: int = 5) -> list[dict[str, Any]]:
    """A scripted reply as chat.completion.chunks, every text and argument string split."""
    def chunk(delta: dict, finish: str | None = None) -> dict[str, Any]:
        return {"id": "c1", "object": "chat.completion.chunk", "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"reasoning_content": p}) for p in _pieces(reply.get("reasoning") or "", piece)
            if p]
    out += [chunk({"content": p}) for p in _pieces(reply.get("content") or "", piece) if p]
    for i, call in enumerate(reply.get("tool_calls") or []):
        out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": {"name": call["name"],
                                                       "arguments": ""}}]}))
        out += [chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]})
                for p in _pieces(call["arguments"], piece) if p]
    out.append(chunk({}, _finish(reply)))
    return out


def _usage(fake: dict, completion: int) -> dict[str, Any]:
    u = fake.get("usage") or {}
    return {"prompt_tokens": u.get("prompt_tokens", 10), "completion_tokens": completion,
            "total_tokens": u.get("prompt_tokens", 10) + completion,
            "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 4)}}


def _completion(body: dict, fake: dict) -> dict[str, Any]:
    reply = fake.get("reply")
    message = reply_message(reply) if reply else {"role": "assistant", "content": "hello"}
    return {"id": "c1", "object": "chat.completion", "model": body.get("model"),
            "choices": [{"index": 0, "finish_reason": _finish(reply) if reply else "stop",
                         "message": message}],
            "usage": _usage(fake, 1), "echo": body}
