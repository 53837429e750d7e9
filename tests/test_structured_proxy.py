"""Structured output through the proxy: the Anthropic Messages API's `output_config.format`
(Claude Code's session-title call) and the Responses API's `text.format` reach the backend as
the chat body's `response_format` (translation, pure), and a managed tiny worker behind a real
prefixd answers the official SDKs with JSON that validates (before, the Messages field was
dropped and the worker refused `response_format` with a 400)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest
from real_schemas import PYDANTIC_ORDER
from schema_check import violation

from prefixd.backends.managed import ManagedBackend
from prefixd.backends.supervision.states import ProcState
from prefixd.proxy.server import Server, make_proxy
from prefixd.proxy.settings import Settings
from prefixd.proxy.translate import AnthropicTranslator, ResponsesTranslator, TranslateError

TITLE = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 24},
    "kind": {"enum": ["question", "task"]}},
    "required": ["title", "kind"], "additionalProperties": False}
MESSAGES = {"model": "tiny", "max_tokens": 200,
            "messages": [{"role": "user", "content": "Name this conversation."}]}


def test_messages_output_config_format_becomes_response_format() -> None:
    fmt = {"type": "json_schema", "schema": TITLE}
    for extra in ({"output_config": {"format": fmt, "effort": "low"}}, {"output_format": fmt}):
        chat = AnthropicTranslator().request({**MESSAGES, **extra})
        assert chat["response_format"] == {"type": "json_schema", "json_schema": {
            "name": "output", "schema": TITLE, "strict": True}}
    assert "response_format" not in AnthropicTranslator().request(
        {**MESSAGES, "output_config": {"effort": "low"}})
    with pytest.raises(TranslateError) as e:
        AnthropicTranslator().request({**MESSAGES, "output_config": {"format": {
            "type": "json_schema"}}})
    assert e.value.param == "output_config.format.schema"


def test_responses_text_format_becomes_response_format() -> None:
    chat = ResponsesTranslator().request({"model": "tiny", "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "title", "schema": TITLE, "strict": True}}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "title", "schema": TITLE, "strict": True}}


@pytest.fixture
async def prefixd(tiny_model_dir: Callable[[str], Path]) -> AsyncIterator[str]:
    settings = Settings(_env_file=None, use_system_blas=False, backends=[
        {"name": "tiny", "kind": "mlx", "model": str(tiny_model_dir("qwen3")),
         "models": ["tiny"]}])
    managed = ManagedBackend(settings.backends[0], settings)
    server = Server(make_proxy(settings, [managed]))
    await server.start("127.0.0.1", 0)
    try:
        await managed.wait_for(ProcState.READY, timeout=120)
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.shutdown(5.0)


@pytest.mark.slow
async def test_messages_output_config_answers_validate(prefixd: str) -> None:
    async with anthropic.AsyncAnthropic(base_url=prefixd, api_key="x", max_retries=0,
                                        timeout=60) as client:
        for seed, streamed in ((0, False), (1, False), (2, True), (3, True)):
            extra = {"output_config": {"format": {"type": "json_schema", "schema": TITLE}},
                     "temperature": 1.0, "metadata": {"user_id": f"u{seed}"}}
            if streamed:
                async with client.messages.stream(**MESSAGES, extra_body=extra) as s:
                    message = await s.get_final_message()
            else:
                message = await client.messages.create(**MESSAGES, extra_body=extra)
            assert message.stop_reason == "end_turn"
            text = "".join(b.text for b in message.content if b.type == "text")
            assert violation(json.loads(text), TITLE) is None, text


@pytest.mark.slow
async def test_responses_text_format_answers_validate(prefixd: str) -> None:
    fmt = {"type": "json_schema", "name": "title", "schema": TITLE, "strict": True}
    async with openai.AsyncOpenAI(base_url=prefixd + "/v1", api_key="x", max_retries=0,
                                  timeout=60) as client:
        for streamed in (False, False, True, True):
            if streamed:
                stream = await client.responses.create(
                    model="tiny", input="Name this conversation.", max_output_tokens=200,
                    text={"format": fmt}, temperature=1.0, stream=True)  # type: ignore[arg-type]
                done = [e async for e in stream if e.type == "response.completed"]
                text = done[0].response.output_text
            else:
                resp = await client.responses.create(
                    model="tiny", input="Name this conversation.", max_output_tokens=200,
                    text={"format": fmt}, temperature=1.0)  # type: ignore[arg-type]
                text = resp.output_text
            assert violation(json.loads(text), TITLE) is None, text


@pytest.mark.slow
async def test_defs_tools_and_cut_calls_through_three_apis(prefixd: str) -> None:
    """A tool whose parameters use pydantic's `$defs`/`$ref` works through every API and
    `tool_choice` (before: a 500 each), and a forced call cut by the length limit is reported
    as a cut in each API's terms, with no call markup as text (before: the cut call leaked)."""
    schema = PYDANTIC_ORDER
    chat_tool = {"type": "function", "function": {"name": "order", "parameters": schema}}
    cases = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Order."}],
                                          "tools": [chat_tool]}, "tool_choice",
                 ("auto", "required", {"type": "function", "function": {"name": "order"}})),
        "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "Order."}],
                                      "tools": [{"name": "order", "input_schema": schema}]},
                     "tool_choice", ({"type": "auto"}, {"type": "any"},
                                     {"type": "tool", "name": "order"})),
        "responses": ("/v1/responses", {"input": "Order.", "tools": [
            {"type": "function", "name": "order", "parameters": schema}]}, "tool_choice",
            ("auto", "required", {"type": "function", "name": "order"})),
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for api, (path, body, key, choices) in cases.items():
            limit = "max_output_tokens" if api == "responses" else "max_tokens"
            for choice in choices:
                req = {"model": "tiny", **body, key: choice, limit: 12, "temperature": 0}
                async with http.post(prefixd + path, json=req) as r:
                    assert r.status == 200, (api, choice, await r.text())
                    out = await r.json()
                assert "<tool_call>" not in json.dumps(out), (api, out)
                if choice in (choices[1], choices[2]):   # forced, and cut at 12 tokens
                    assert _cut(api, out), (api, choice, out)


def _cut(api: str, out: dict) -> bool:
    """Whether `out` reports a reply cut by the length limit, with no finished call."""
    if api == "chat":
        choice = out["choices"][0]
        return choice["finish_reason"] == "length" and not choice["message"].get("tool_calls")
    if api == "messages":
        return out["stop_reason"] == "max_tokens" and all(
            b["type"] != "tool_use" for b in out["content"])
    return out["status"] == "incomplete" and out["incomplete_details"] == {
        "reason": "max_output_tokens"} and all(i["type"] != "function_call"
                                               for i in out["output"])


@pytest.mark.slow
async def test_messages_stop_sequences_are_named_and_never_cut_a_call(prefixd: str) -> None:
    """Through the Messages API on prefixd's own worker: a stop sequence that ended the reply
    is reported (`stop_reason: stop_sequence`, `stop_sequence` set; before: `end_turn` and
    null), streamed and not, and a forced tool call with stop sequences that occur inside it
    still comes back as the call (before: its markup as a text block, `end_turn`)."""
    weather = {"name": "weather", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"], "additionalProperties": False}}
    ask = {"model": "tiny", "max_tokens": 40, "extra_body": {"temperature": 0},
           "messages": [{"role": "user", "content": "Tell me about the river."}]}
    async with anthropic.AsyncAnthropic(base_url=prefixd, api_key="x", max_retries=0,
                                        timeout=60) as client:
        free = await client.messages.create(**ask)
        text = "".join(b.text for b in free.content if b.type == "text")
        stop = text[6:9]
        assert len(stop) == 3 and free.stop_sequence is None
        cut = await client.messages.create(**ask, stop_sequences=[stop])
        assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
        assert "".join(b.text for b in cut.content if b.type == "text") == \
            text[:text.index(stop)]
        async with client.messages.stream(**ask, stop_sequences=[stop]) as s:
            streamed = await s.get_final_message()
        assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
        forced = await client.messages.create(
            **{**ask, "max_tokens": 200}, tools=[weather],
            tool_choice={"type": "tool", "name": "weather"}, stop_sequences=["\n", '"'])
        assert forced.stop_reason == "tool_use", forced
        assert [b.type for b in forced.content] == ["tool_use"], forced.content
