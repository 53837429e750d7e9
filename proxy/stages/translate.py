"""translate: the client's API → the one internal form, an OpenAI chat/completions request
validated by the shared schema (`prefixd.api.schema`). OpenAI's own APIs are the identity;
other client APIs (Anthropic Messages, OpenAI Responses) go through their translator, whose
output is validated like any client's body, and are answered back through it by relay.

Structured output is decided here, before the queue: the request's JSON schemas (response
format, tool parameters) are compiled as a prefixd worker will enforce them
(`prefixd.api.structured`), and one that cannot be is a 400 naming the client's own field;
the compile time goes to the request's log line (`grammar_ms`) and
`prefixd_grammar_check_seconds`."""

from __future__ import annotations

import asyncio
import json
import time

from prefixd.api.schema import ChatRequest, Parsed, validate
from prefixd.api.structured import check, constraint
from prefixd.metrics.proxy import GRAMMAR_CHECK
from prefixd.proxy.exchange import Exchange
from prefixd.proxy.stages import Next
from prefixd.proxy.translate.base import Translator


class TranslateStage:
    name = "translate"

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        api = ex.api
        if api.translator is None:
            ex.parsed = Parsed(api.kind, ex.raw, ex.client_body,
                               validate(api.kind, ex.client_body))
        else:
            body = api.translator.chat_request(ex.client_body)
            ex.parsed = Parsed(api.kind, json.dumps(body, ensure_ascii=False).encode(), body,
                               validate(api.kind, body))
        req = ex.parsed.req
        if req.response_format is not None or (isinstance(req, ChatRequest) and req.tools):
            t0 = time.perf_counter()
            await asyncio.to_thread(check_structured, ex.parsed, api.translator, ex.client_body)
            seconds = time.perf_counter() - t0
            GRAMMAR_CHECK.observe(seconds)
            ex.trace.grammar_ms = round(1000 * seconds, 2)
        await call_next(ex)


def check_structured(parsed: Parsed, translator: Translator | None, client_body: dict) -> None:
    """400 (naming the client's field) for a schema a prefixd worker could not enforce."""
    def where(param: str) -> str:
        return param if translator is None else translator.client_param(client_body, param)

    req = parsed.req
    # forms a prefixd worker refuses (other response_format types, tool_choice shapes) are
    # left to the backend: another kind of backend may know them
    fmt = req.response_format if (req.response_format or {}).get("type") == "json_schema" \
        else None
    tools, choice = None, None
    if isinstance(req, ChatRequest) and req.tool_choice != "none":
        tools, choice = parsed.body.get("tools"), req.tool_choice
        if not (choice in (None, "auto", "required") or (
                isinstance(choice, dict) and choice.get("type") == "function")):
            choice = None
    parallel = req.parallel_tool_calls if isinstance(req, ChatRequest) else None
    check(constraint(fmt, tools if isinstance(tools, list) else None, choice, parallel, where),
          where)
