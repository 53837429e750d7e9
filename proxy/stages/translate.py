"""translate: the client's API → the one internal form, an OpenAI chat/completions request
validated by the shared schema (`prefixd.api.schema`). OpenAI's own APIs are the identity;
other client APIs (Anthropic Messages, OpenAI Responses) go through their translator, whose
output is validated like any client's body, and are answered back through it by relay."""

from __future__ import annotations

import json

from prefixd.api.errors import ApiError
from prefixd.api.schema import Parsed, validate
from prefixd.proxy.exchange import Exchange
from prefixd.proxy.stages import Next
from prefixd.proxy.translate.base import TranslateError, Translator


class TranslateStage:
    name = "translate"

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        api = ex.api
        if api.translator is None:
            ex.parsed = Parsed(api.kind, ex.raw, ex.client_body,
                               validate(api.kind, ex.client_body))
        else:
            body = translate_request(api.translator, ex.client_body)
            ex.parsed = Parsed(api.kind, json.dumps(body, ensure_ascii=False).encode(), body,
                               validate(api.kind, body))
        await call_next(ex)


def translate_request(translator: Translator, body: dict) -> dict:
    try:
        return translator.request(body)
    except TranslateError as e:
        raise ApiError(400, e.message, param=e.param, code="invalid_request") from None
