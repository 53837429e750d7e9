"""The mlx worker's HTTP app: the OpenAI endpoints and the worker's own (health, cache, tokenize).

Owns: routes, the optional per-start token (`PREFIXD_WORKER_TOKEN`: every route but /health then
needs `Authorization: Bearer <token>`), every body read within `body_timeout_s` (`api/reading.py`),
the transfer secret the state-move endpoints sign and check bundles with (`server/cacheio.py`),
reading requests (the shared schema `api.schema`, then `chat/request.py`'s `gen_request`),
building prompts beside generation, and noticing a client that went away. Answers are written by
`server/respond.py`; everything mlx lives on the scheduler's generation thread
(`scheduler/generator.py`). A handler never raises to aiohttp: client mistakes are 4xx OpenAI
errors (`ApiError`), a generation failure is a 500 or, once a stream has started, an SSE error
event.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from prefixd.api.errors import ApiError, errors_middleware
from prefixd.api.reading import body_deadline
from prefixd.api.schema import Kind, cache_namespace, decode_json, parse_body
from prefixd.backends.mlx.chat.oai import ChatOutput, Shapes
from prefixd.backends.mlx.chat.prompt import Prompt, Renderer, encode
from prefixd.backends.mlx.chat.request import GenRequest, check_vocab, gen_request, parse_request
from prefixd.backends.mlx.engine.loading import Loaded
from prefixd.backends.mlx.engine.transfer import bundle
from prefixd.backends.mlx.model.memory import memory_info
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.scheduler.jobs import WorkerClosed
from prefixd.backends.mlx.server import cacheio, scrape
from prefixd.backends.mlx.server.respond import Reply
from prefixd.backends.mlx.settings import WorkerSettings
from prefixd.metrics import CONTENT_TYPE, render

log = logging.getLogger("prefixd.worker")
GENERATOR = web.AppKey("generator", Generator)
MODEL_NAME = web.AppKey("model_name", str)
SETTINGS = web.AppKey("settings", WorkerSettings)    # its transfer secret signs and checks
TOKEN_ENV = "PREFIXD_WORKER_TOKEN"  # a secret per worker start, set by its supervisor
OPEN_PATHS = frozenset({"/health"})
STREAMED = frozenset({"/v1/cache/import"})   # reads its body itself, inside the same deadline


def create_app(generator: Generator, model_name: str, settings: WorkerSettings,
               token: str | None = None) -> web.Application:
    """The worker app around a `Generator` (loaded now or later: /health says which). With a
    `token`, every route but /health requires `Authorization: Bearer <token>`."""
    middlewares: list[Middleware] = [errors_middleware] + ([_auth(token)] if token else []) \
        + [body_deadline(settings.body_timeout_s, STREAMED)]
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    app[GENERATOR] = generator
    app[MODEL_NAME] = model_name
    app[SETTINGS] = settings
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/cache", _cache)
    app.router.add_post("/v1/cache/export", _export)
    app.router.add_post("/v1/cache/import", _import)
    app.router.add_get("/metrics", _metrics)
    return app


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _auth(token: str) -> Middleware:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(got, expected):
                raise ApiError(401, "this worker needs its token: Authorization: Bearer <token>",
                               code="invalid_api_key")
        return await handler(request)

    return auth


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


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    req = gen_request(parse_body(kind, await request.read()))
    loaded = _loaded(request)
    check_vocab(req, len(loaded.tokenizer))
    generator = request.app[GENERATOR]
    prompt = await _build(loaded.renderer, req)
    max_tokens = _max_tokens(loaded, req, prompt, generator.settings.max_tokens_default)
    shapes = Shapes(kind, request.app[MODEL_NAME])
    try:
        job = generator.submit(prompt, req.sampling, max_tokens, req.logprobs,
                               cache_namespace(request.headers))
    except WorkerClosed:
        raise ApiError(503, "the worker is shutting down", type_="server_error") from None
    reply = Reply(req, shapes, job, _output(loaded, req, prompt))
    try:
        return await (reply.stream(request) if req.stream else reply.collect())
    finally:
        job.cancel()  # no-op after the end; stops generation if the client left (cancellation)


async def _build(renderer: Renderer, req: GenRequest, boundaries: bool = True) -> Prompt:
    """Render and tokenize on a thread, beside generation. If the client leaves meanwhile
    (aiohttp cancels the handler), rendering message prefixes stops at the next one."""
    left = threading.Event()
    try:
        return await asyncio.to_thread(renderer.build, req, boundaries=boundaries,
                                       should_stop=left.is_set)
    finally:
        left.set()


def _output(loaded: Loaded, req: GenRequest, prompt: Prompt) -> ChatOutput:
    """How this reply's text is split into reasoning, content and tool calls."""
    if req.kind != "chat":
        return ChatOutput()
    tokenizer = loaded.tokenizer
    tools = loaded.renderer.tool_format() if req.tools else None
    if not getattr(tokenizer, "has_thinking", False):
        return ChatOutput(tools, req.tools)
    return ChatOutput(tools, req.tools, (tokenizer.think_start, tokenizer.think_end),
                      prompt.thinking)


async def _tokenize(request: web.Request) -> web.Response:
    """{"messages": [...], "tools": [...]} → the chat prompt's ids (with the generation
    prompt) and message boundaries (`"boundaries": false` skips them: only the ids), or
    {"content": "text", "add_special": false} → the text's ids."""
    body = decode_json(await request.read())
    loaded = _loaded(request)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_body")
    if "messages" not in body:
        content = body.get("content")
        if not isinstance(content, str):
            raise ApiError(400, "give 'messages' or a string 'content'", param="content")
        tokens = await asyncio.to_thread(encode, loaded.tokenizer, content,
                                         bool(body.get("add_special", False)))
        return web.json_response({"tokens": tokens})
    want = body.get("boundaries", True)
    if not isinstance(want, bool):
        raise ApiError(400, "'boundaries' must be a boolean", param="boundaries",
                       code="invalid_type")
    prompt = await _build(loaded.renderer, parse_request("chat", body), boundaries=want)
    if not want:
        return web.json_response({"tokens": prompt.tokens})
    return web.json_response({"tokens": prompt.tokens, "boundaries": prompt.boundaries})


async def _models(request: web.Request) -> web.Response:
    """The one model, with its context window (`context_length`, from its config) once it
    is loaded and known: the proxy enforces it."""
    model: dict = {"id": request.app[MODEL_NAME], "object": "model",
                   "created": int(time.time()), "owned_by": "prefixd"}
    loaded = request.app[GENERATOR].loaded
    if loaded is not None and loaded.max_context is not None:
        model["context_length"] = loaded.max_context
    return web.json_response({"object": "list", "data": [model]})


async def _health(request: web.Request) -> web.Response:
    if request.app[GENERATOR].loaded is None:
        return web.json_response({"status": "loading"}, status=503)
    return web.json_response({"status": "ok"})


async def _cache(request: web.Request) -> web.Response:
    """The Engine's cache_info and MLX's memory as of the end of the last generation (the
    Engine is only ever touched on the generation thread, so this never waits behind a long
    request), with the disk tier's live state (its own lock guards it), a group's other ranks
    as last heard (their heartbeats: never a round trip) and the process's resident memory now:
    the proxy's model pool measures a loaded model's footprint by it."""
    loaded = _loaded(request)
    generator = request.app[GENERATOR]
    status = generator.status
    group = None if not generator.grouped else {
        "hosts": generator.settings.group_hosts, "parallel": loaded.parallel,
        "ranks": [{"rank": 0, "host": generator.settings.group_hosts[0], "pid": os.getpid(),
                   "memory": memory_info(status.memory)}, *generator.lockstep.ranks()]}
    events = generator.announcer.info() if generator.announcer is not None else None
    return web.json_response({**status.cache_info, "disk": loaded.engine.tiers.info(),
                              "kv_events": events,
                              "worker": dict(status.stats), "group": group,
                              "memory": memory_info(status.memory)})


def _single(request: web.Request) -> None:
    """Prefix states move between single-process workers only (for now: docs/DISTRIBUTED.md)."""
    if request.app[GENERATOR].grouped:
        raise ApiError(501, "a group worker does not export or import prefix states",
                       type_="server_error", code="group_worker")


async def _export(request: web.Request) -> web.Response:
    """A chat or completions body → the state of the longest prefix of its prompt this worker
    restores (RAM or disk), as a bundle (`engine/transfer/bundle.py`) with `X-Prefixd-Tokens:
    <pos>` and,
    with a transfer secret, its MAC (`cacheio.signed`); 404 when it holds none. Runs on the
    generation thread, after the request in progress."""
    _single(request)
    raw = await request.read()
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_body")
    req = gen_request(parse_body("chat" if "messages" in body else "completion", raw))
    namespace = cache_namespace(request.headers)
    loaded = _loaded(request)
    prompt = await _build(loaded.renderer, req, boundaries=False)
    try:
        found = await request.app[GENERATOR].call(
            lambda e: bundle.export(e, prompt.tokens, namespace))
    except WorkerClosed:
        raise ApiError(503, "the worker is shutting down", type_="server_error") from None
    if found is None:
        raise ApiError(404, "no prefix of this prompt is cached here", code="not_cached")
    data, pos = found
    return cacheio.signed(data, pos, request.app[SETTINGS].transfer_secret)


async def _import(request: web.Request) -> web.Response:
    """A signed bundle another worker of this model exported → stored in this worker's prompt
    cache, or refused with a named 4xx before anything is stored (`server/cacheio.py`)."""
    _single(request)
    settings = request.app[SETTINGS]
    return await cacheio.import_state(request, _loaded(request), request.app[GENERATOR],
                                      settings.transfer_secret, settings.body_timeout_s)


async def _metrics(request: web.Request) -> web.Response:
    """Every metric of this process, the load under vLLM's names set now (`scrape.py`)."""
    scrape.observe(request.app[GENERATOR], request.app[MODEL_NAME])
    return web.Response(body=render(), headers={"Content-Type": CONTENT_TYPE})
