"""The mlx worker's HTTP app: the OpenAI endpoints and the worker's own (health, cache, tokenize).

Owns: routes, reading and answering requests, streaming SSE, noticing a client that went away.
Parsing lives in `chat.py`, response shapes in `oai.py`, everything mlx in `generation.py`.
A handler never raises to aiohttp: client mistakes are 4xx OpenAI errors (`ApiError`), a
generation failure is a 500 or, once a stream has started, an SSE error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Literal

from aiohttp import web

from prefixd.api.errors import ApiError, error_response, errors_middleware
from prefixd.backends.mlx.chat import GenRequest, Prompt, build_prompt, encode, parse_request
from prefixd.backends.mlx.generation import Failed, Finished, Generator, Job, Loaded
from prefixd.backends.mlx.oai import DONE, ChatOutput, Shapes, ToolFormat, sse, usage
from prefixd.backends.mlx.settings import WorkerSettings
from prefixd.metrics import CONTENT_TYPE, render

log = logging.getLogger("prefixd.worker")
GENERATOR = web.AppKey("generator", Generator)
MODEL_NAME = web.AppKey("model_name", str)


def create_app(generator: Generator, model_name: str, settings: WorkerSettings) -> web.Application:
    """The worker app around a `Generator` (loaded now or later: /health says which)."""
    app = web.Application(middlewares=[errors_middleware], client_max_size=settings.max_body_bytes)
    app[GENERATOR] = generator
    app[MODEL_NAME] = model_name
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/cache", _cache)
    app.router.add_get("/metrics", _metrics)
    return app


async def _json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


def _loaded(request: web.Request) -> Loaded:
    loaded = request.app[GENERATOR].loaded
    if loaded is None:
        raise ApiError(503, "the model is still loading", type_="server_error",
                       headers={"Retry-After": "1"})
    return loaded


def _max_tokens(loaded: Loaded, req: GenRequest, prompt: Prompt, default: int) -> int:
    """Reject a prompt that leaves no room to generate; clamp max_tokens to the context."""
    n, param = len(prompt.tokens), "messages" if req.kind == "chat" else "prompt"
    if n == 0:
        raise ApiError(400, "the prompt is empty", param=param)
    room = None if loaded.max_context is None else loaded.max_context - n
    if room is not None and room < 1:
        raise ApiError(400, f"the prompt is {n} tokens; this model's context is "
                       f"{loaded.max_context} tokens", param=param,
                       code="context_length_exceeded")
    wanted = req.sampling.max_tokens or default
    return wanted if room is None else min(wanted, room)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def _generate(request: web.Request, kind: Literal["chat", "completion"]
                    ) -> web.StreamResponse:
    req = parse_request(await _json(request), kind)
    loaded = _loaded(request)
    generator = request.app[GENERATOR]
    # Tokenizing (and rendering message prefixes) runs beside generation, not behind it.
    prompt = await asyncio.to_thread(build_prompt, loaded.tokenizer, req)
    max_tokens = _max_tokens(loaded, req, prompt, generator.settings.max_tokens_default)
    shapes = Shapes(kind, request.app[MODEL_NAME])
    output = _output(loaded.tokenizer, req, prompt)
    job = generator.submit(prompt, req.sampling, max_tokens)
    try:
        if req.stream:
            return await _stream(request, req, shapes, job, output)
        return await _collect(shapes, job, output)
    finally:
        job.cancel()  # no-op after the end; stops generation if the client left (cancellation)


def _output(tokenizer: Any, req: GenRequest, prompt: Prompt) -> ChatOutput:
    """How this reply's text is split into reasoning, content and tool calls."""
    if req.kind != "chat":
        return ChatOutput()
    tools = ToolFormat.of(tokenizer) if req.tools else None
    if not getattr(tokenizer, "has_thinking", False):
        return ChatOutput(tools, req.tools)
    # A generation prompt that opens a think block (and does not close it) starts in reasoning.
    tail = prompt.tokens[-16:]
    thinking = tokenizer.rfind_think_start(tail) > tokenizer.rfind_think_end(tail)
    return ChatOutput(tools, req.tools, (tokenizer.think_start, tokenizer.think_end), thinking)


def _usage(job: Job, end: Finished) -> dict[str, Any]:
    return usage(len(job.prompt.tokens), end.completion_tokens, end.cached_tokens)


def _stopped() -> ApiError:
    return ApiError(503, "the worker stopped this generation (shutting down)",
                    type_="server_error")


async def _collect(shapes: Shapes, job: Job, output: ChatOutput) -> web.Response:
    reasoning: list[str] = []
    content: list[str] = []
    async for event in job.events():
        if isinstance(event, str):
            r, c = output.feed(event)
            reasoning.append(r)
            content.append(c)
        elif isinstance(event, Failed):
            return error_response(500, event.message)
        elif event.finish_reason == "cancelled":
            return _stopped().response()
        else:
            r, c, calls = output.finish()
            finish = "tool_calls" if calls else event.finish_reason
            return web.json_response(shapes.final(
                "".join(content) + c, finish, _usage(job, event), tool_calls=calls,
                reasoning="".join(reasoning) + r))
    raise AssertionError("a job's events end with Finished or Failed")


async def _stream(request: web.Request, req: GenRequest, shapes: Shapes, job: Job,
                  output: ChatOutput) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        if req.kind == "chat":
            await resp.write(sse(shapes.chunk(role=True)))
        async for event in job.events():
            if isinstance(event, str):
                r, c = output.feed(event)
                if r or c:
                    await resp.write(sse(shapes.chunk(c, reasoning=r)))
            elif isinstance(event, Failed):
                await resp.write(ApiError(500, event.message, type_="server_error").sse_event())
                return resp
            elif event.finish_reason == "cancelled":  # shutdown; a gone client reads nothing
                await resp.write(_stopped().sse_event())
                return resp
            else:
                await _stream_end(resp, req, shapes, output, job, event)
        await resp.write(DONE)
        await resp.write_eof()
    except ConnectionResetError:
        log.info("worker: client went away mid-stream; generation stopped")
    return resp


async def _stream_end(resp: web.StreamResponse, req: GenRequest, shapes: Shapes,
                      output: ChatOutput, job: Job, end: Finished) -> None:
    r, c, calls = output.finish()
    if r or c:
        await resp.write(sse(shapes.chunk(c, reasoning=r)))
    if calls:
        await resp.write(sse(shapes.chunk(tool_calls=calls)))
    await resp.write(sse(shapes.chunk(finish_reason="tool_calls" if calls
                                      else end.finish_reason)))
    if req.include_usage:
        await resp.write(sse(shapes.usage_chunk(_usage(job, end))))


async def _tokenize(request: web.Request) -> web.Response:
    """{"messages": [...], "tools": [...]} → the chat prompt's ids (with the generation
    prompt), or {"content": "text", "add_special": false} → the text's ids."""
    body = await _json(request)
    loaded = _loaded(request)
    if isinstance(body, dict) and "messages" not in body:
        content = body.get("content")
        if not isinstance(content, str):
            raise ApiError(400, "give 'messages' or a string 'content'", param="content")
        tokens = await asyncio.to_thread(encode, loaded.tokenizer, content,
                                         bool(body.get("add_special", False)))
        return web.json_response({"tokens": tokens})
    prompt = await asyncio.to_thread(build_prompt, loaded.tokenizer, parse_request(body, "chat"))
    return web.json_response({"tokens": prompt.tokens, "boundaries": prompt.boundaries})


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": request.app[MODEL_NAME], "object": "model", "created": int(time.time()),
         "owned_by": "prefixd"}]})


async def _health(request: web.Request) -> web.Response:
    if request.app[GENERATOR].loaded is None:
        return web.json_response({"status": "loading"}, status=503)
    return web.json_response({"status": "ok"})


async def _cache(request: web.Request) -> web.Response:
    """The Engine's cache_info as of the end of the last generation (the Engine is only ever
    touched on the generation thread, so this never waits behind a long request)."""
    _loaded(request)
    generator = request.app[GENERATOR]
    return web.json_response({**generator.cache_info, "worker": dict(generator.stats)})


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=render(), headers={"Content-Type": CONTENT_TYPE})
