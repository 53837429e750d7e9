"""Structured output decided in the proxy, before the queue: a schema no grammar can enforce (a
`$ref` to nothing) is a 400 from prefixd itself, naming the field in the API the client used
(Chat `response_format.json_schema.schema` / `tools[i].function.parameters`, Messages
`output_config.format.schema` / `tools.<k>.input_schema`, Responses `text.format.schema` /
`tools[k].parameters`), and the backend never sees it (before: forwarded, refused by the
worker after the queue with Chat's names). Schemas the worker enforces (pydantic `$defs` in a
tool, keywords it ignores) pass; compiling them is timed on the request's log line
(`grammar_ms`) and in `prefixd_grammar_check_seconds`."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import pytest
from fake_upstream import FakeUpstream
from proxy_fixtures import StartProxy
from real_schemas import PYDANTIC_ORDER, UNENFORCEABLE

BROKEN = {"type": "object", "properties": {"home": {"$ref": "#/$defs/Address"}}}
FINE = {"type": "object", "properties": {"city": {"type": "string"}}}
USER = [{"role": "user", "content": "hi"}]
# OpenAPI-style inheritance: closing either part would forbid the other's required key
MERGED = {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}},
                             "required": ["id"]}},
          "allOf": [{"$ref": "#/$defs/Base"},
                    {"type": "object", "properties": {"name": {"type": "string"}},
                     "required": ["name"]}]}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": USER, **extra}


def fn(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def messages(**extra: Any) -> dict[str, Any]:
    return {"model": "fake", "max_tokens": 50, "messages": USER, **extra}


def responses(**extra: Any) -> dict[str, Any]:
    return {"model": "fake", "input": "hi", **extra}


# (path, body, the field the error must name)
REFUSED = {
    "chat_format": ("/v1/chat/completions", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": BROKEN}}),
        "response_format.json_schema.schema"),
    "chat_tool": ("/v1/chat/completions", chat(tools=[fn("a", FINE), fn("b", BROKEN)]),
                  "tools[1].function.parameters"),
    "messages_format": ("/v1/messages", messages(output_config={"format": {
        "type": "json_schema", "schema": BROKEN}}), "output_config.format.schema"),
    "messages_tool": ("/v1/messages", messages(tools=[
        {"type": "web_search_20250305", "name": "web_search"},
        {"name": "a", "input_schema": FINE}, {"name": "b", "input_schema": BROKEN}],
        tool_choice={"type": "any"}), "tools.2.input_schema"),
    "responses_format": ("/v1/responses", responses(text={"format": {
        "type": "json_schema", "name": "a", "schema": BROKEN}}), "text.format.schema"),
    "responses_tool": ("/v1/responses", responses(tools=[
        {"type": "web_search"},
        {"type": "namespace", "name": "ns", "tools": [
            {"type": "function", "name": "a", "parameters": FINE},
            {"type": "function", "name": "b", "parameters": BROKEN}]}]),
        "tools[1].tools[1].parameters"),
}


@pytest.mark.parametrize("case", REFUSED)
async def test_a_schema_no_grammar_can_enforce_is_refused_before_the_queue(
        case: str, upstream: FakeUpstream, start_proxy: StartProxy,
        http: aiohttp.ClientSession) -> None:
    path, body, field = REFUSED[case]
    proxy = await start_proxy(upstream.url)
    async with http.post(f"http://127.0.0.1:{proxy.port}{path}", json=body) as r:
        answer = await r.json()
        assert r.status == 400, answer
    error = answer["error"]
    assert f"'{field}'" in error["message"] and "$defs/Address" in error["message"], error
    if not path.endswith("messages"):      # Anthropic's errors carry no param
        assert error["param"] == field, error
    else:
        assert answer["type"] == "error" and error["type"] == "invalid_request_error"
    assert upstream.received == []


async def test_schemas_the_worker_enforces_pass_and_are_timed(
        upstream: FakeUpstream, start_proxy: StartProxy, http: aiohttp.ClientSession,
        caplog: pytest.LogCaptureFixture) -> None:
    proxy = await start_proxy(upstream.url)
    base = f"http://127.0.0.1:{proxy.port}"
    async with http.get(base + "/metrics") as r:
        before = _count(await r.text())
    bodies = [chat(tools=[fn("order", PYDANTIC_ORDER)], tool_choice=choice)
              for choice in ("auto", "required")]
    bodies += [chat(response_format={"type": "json_schema", "json_schema": {
        "name": name, "schema": schema}}) for name, schema in {**UNENFORCEABLE,
                                                              "merged": MERGED}.items()]
    caplog.set_level(logging.INFO, "prefixd.request")
    for body in bodies:
        async with http.post(base + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
    assert len(upstream.received) == len(bodies)
    async with http.get(base + "/metrics") as r:
        assert _count(await r.text()) == before + len(bodies)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "prefixd.request"]
    assert sum("grammar_ms=" in line for line in lines) == len(bodies), lines


def _count(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("prefixd_grammar_check_seconds_count"):
            return float(line.split()[-1])
    return 0.0
