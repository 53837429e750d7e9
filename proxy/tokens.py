"""`POST /v1/messages/count_tokens` (Anthropic): the prompt's token count, exact where a
backend of the model can tokenize, else an estimate marked `X-Prefixd-Estimate`. Counting is
not serving: no routing decision is made or counted."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from aiohttp import web

from prefixd.api.errors import ApiError
from prefixd.api.reading import read_body
from prefixd.api.schema import decode_json, validate
from prefixd.proxy.apis import API_BY_PATH
from prefixd.proxy.pipeline import Proxy
from prefixd.proxy.translate.anthropic import count_tokens_request
from prefixd.proxy.translate.base import TranslateError

CHARS_PER_TOKEN = 4
Handler = Callable[[web.Request], Awaitable[web.Response]]


def count_tokens(proxy: Proxy) -> Handler:
    """The route's handler for `proxy`."""
    async def handle(request: web.Request) -> web.Response:
        return await _count(proxy, request)
    return handle


async def _count(proxy: Proxy, request: web.Request) -> web.Response:
    api = API_BY_PATH["/v1/messages"]
    try:
        body = decode_json(await read_body(request, proxy.settings.body_timeout_s))
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_body")
        try:
            chat = count_tokens_request(body)    # no max_tokens, never a stream
        except TranslateError as e:
            raise ApiError(400, e.message, param=e.param, code="invalid_request") from None
        validate("chat", chat)
        model = proxy.router.model_for(chat.get("model"))
        backend = proxy.router.tokenizer_for(model)
        tokens = await backend.tokenize({**chat, "model": model})
    except ApiError as e:
        resp = web.json_response(api.error_body(e), status=e.status)
        if e.status == 408:              # a body too slow: the connection goes too
            resp.force_close()
        return resp
    if tokens is not None:
        return web.json_response({"input_tokens": len(tokens)})
    estimate = len(json.dumps(chat, ensure_ascii=False)) // CHARS_PER_TOKEN
    return web.json_response({"input_tokens": estimate}, headers={"X-Prefixd-Estimate": "chars/4"})
