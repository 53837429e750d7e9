"""Structured output on the real worker app with a tiny random-weight Qwen3 (its free output is
garbage: the grammar alone must make every answer valid): `response_format` json_schema and
json_object, required and named tool calls, optional tools (free text or a valid call),
streamed and not, and the prompt cache unchanged by the mask (a warm answer equals the cold
one). Before structured output the worker answered each of these with a 400."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from schema_check import violation
from worker_fixtures import chat, post, stream, streamed_text

from prefixd.backends.mlx.scheduler.generator import Generator

NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"], "additionalProperties": False},
    "active": {"type": "boolean"}},
    "required": ["user", "active"], "additionalProperties": False}
TAGS = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
             "minItems": 1, "maxItems": 4},
    "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["tags", "score"], "additionalProperties": False}
ROWS = {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "label": {"type": "string", "maxLength": 8}},
    "required": ["id", "label"], "additionalProperties": False}}
OPTIONAL = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 20},
    "priority": {"enum": ["low", "high"]},
    "note": {"type": ["string", "null"], "maxLength": 5}},
    "required": ["title", "priority"], "additionalProperties": False}
TITLE = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30}},
         "required": ["title"], "additionalProperties": False}  # Claude Code's title call
SCHEMAS = {"nested": NESTED, "tags": TAGS, "rows": ROWS, "optional": OPTIONAL, "title": TITLE}

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SEEDS = range(4)


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}


def body(seed: int, **extra: Any) -> dict[str, Any]:
    return chat(temperature=1.0, seed=seed, max_tokens=300, **extra)


def token_id(generator: Generator, text: str) -> int:
    assert generator.loaded is not None
    ids = generator.loaded.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1
    return int(ids[0])


def check_calls(calls: list[dict[str, Any]], names: set[str]) -> None:
    assert calls
    for call in calls:
        fn = call["function"]
        assert fn["name"] in names
        assert violation(json.loads(fn["arguments"]), PARAMS[fn["name"]]) is None, fn


@pytest.mark.parametrize("name", SCHEMAS)
async def test_json_schema_answers_validate(client: TestClient, name: str) -> None:
    schema = SCHEMAS[name]
    for seed in SEEDS:
        out = await post(client, body(seed, response_format=json_schema(schema)))
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        value = json.loads(choice["message"]["content"])
        assert violation(value, schema) is None, (seed, value)


@pytest.mark.parametrize("name", ["nested", "rows"])
async def test_json_schema_streamed(client: TestClient, name: str) -> None:
    for seed in SEEDS:
        events = await stream(client, body(seed, response_format=json_schema(SCHEMAS[name])))
        assert events[-1] == "[DONE]"
        assert violation(json.loads(streamed_text(events)), SCHEMAS[name]) is None


async def test_json_object_answers_are_objects(client: TestClient,
                                               generator: Generator) -> None:
    """A bias toward `"` keeps the garbage model's strings short (it would never close them
    on its own); without the grammar the same bias gives no JSON at all."""
    bias = {str(token_id(generator, '"')): 100}
    free = await post(client, body(0, logit_bias=bias))
    with pytest.raises(json.JSONDecodeError):
        json.loads(free["choices"][0]["message"]["content"])
    for seed in SEEDS:
        out = await post(client, body(seed, logit_bias=bias,
                                      response_format={"type": "json_object"}))
        assert isinstance(json.loads(out["choices"][0]["message"]["content"]), dict)


async def test_required_tool_calls_validate(client: TestClient) -> None:
    for seed in SEEDS:
        out = await post(client, body(seed, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False))
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        check_calls(choice["message"]["tool_calls"], {"weather", "clock"})
        assert len(choice["message"]["tool_calls"]) == 1


async def test_named_tool_call(client: TestClient) -> None:
    named = {"type": "function", "function": {"name": "clock"}}
    for seed in SEEDS:
        out = await post(client, body(seed, tools=TOOLS, tool_choice=named))
        check_calls(out["choices"][0]["message"]["tool_calls"], {"clock"})


async def test_required_tool_calls_streamed(client: TestClient) -> None:
    for seed in SEEDS:
        events = await stream(client, body(seed, tools=TOOLS, tool_choice="required"))
        calls = [c for e in events[:-1] if e["choices"]
                 for c in e["choices"][0]["delta"].get("tool_calls") or []]
        check_calls(calls, {"weather", "clock"})
        assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


async def test_optional_tools_free_text_or_a_valid_call(client: TestClient,
                                                        generator: Generator) -> None:
    """With `tool_choice` auto the model writes freely; pushed to open a call (a bias on the
    `<tool_call>` token), what follows the marker is a valid call."""
    for seed in SEEDS:
        out = await post(client, body(seed, tools=TOOLS))
        message = out["choices"][0]["message"]
        assert "tool_calls" not in message and "<tool_call>" not in message["content"]
    bias = {str(token_id(generator, "<tool_call>")): 30}
    for seed in SEEDS:
        out = await post(client, body(seed, tools=TOOLS, logit_bias=bias,
                                      parallel_tool_calls=False))
        message = out["choices"][0]["message"]
        check_calls(message["tool_calls"], {"weather", "clock"})
        assert "<tool_call>" not in message["content"]


async def test_completions_json_schema(client: TestClient) -> None:
    for seed in SEEDS:
        out = await post(client, {"prompt": "The river", "seed": seed, "max_tokens": 300,
                                  "response_format": json_schema(TAGS)}, "/v1/completions")
        assert violation(json.loads(out["choices"][0]["text"]), TAGS) is None


async def test_the_mask_leaves_the_prompt_cache_alone(client: TestClient) -> None:
    """The grammar only masks decode logits: the same request again hits the cache the first
    one left and answers the same (greedy) JSON."""
    req = chat(max_tokens=300, response_format=json_schema(NESTED),
               messages=[{"role": "user", "content": "A fresh question about the sea. " * 4}])
    cold = await post(client, req)
    warm = await post(client, req)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert violation(json.loads(cold["choices"][0]["message"]["content"]), NESTED) is None


# stop strings that occur inside every call and every JSON answer: the markup's line breaks,
# the quotes of every key, the colon after it
INSIDE = ["\n", '"', ":"]


async def test_stop_strings_do_not_cut_structure(client: TestClient, generator: Generator
                                                 ) -> None:
    """Stop strings end text, not structure: a named call, a required call (streamed too), a
    schema's JSON and a call the model opens with tools auto come back whole, with stop strings
    that occur inside each. Before, the reply ended inside the markup and came back as text
    (`<tool_call>`, `finish_reason` stop) or as JSON that does not parse."""
    named = {"type": "function", "function": {"name": "clock"}}
    bias = {str(token_id(generator, "<tool_call>")): 30}
    for seed in SEEDS:
        for extra in ({"tool_choice": named}, {"tool_choice": "required"},
                      {"logit_bias": bias}):
            out = await post(client, body(seed, tools=TOOLS, stop=INSIDE,
                                          parallel_tool_calls=False, **extra))
            choice = out["choices"][0]
            assert choice["finish_reason"] == "tool_calls", (extra, choice)
            check_calls(choice["message"]["tool_calls"], {"weather", "clock"})
            assert "<tool_call>" not in (choice["message"]["content"] or "")
        out = await post(client, body(seed, response_format=json_schema(TAGS), stop=INSIDE))
        assert violation(json.loads(out["choices"][0]["message"]["content"]), TAGS) is None
        events = await stream(client, body(seed, tools=TOOLS, tool_choice="required",
                                           stop=INSIDE))
        calls = [c for e in events[:-1] if e["choices"]
                 for c in e["choices"][0]["delta"].get("tool_calls") or []]
        check_calls(calls, {"weather", "clock"})


async def test_a_stop_string_ends_text_before_a_call_and_is_named(client: TestClient) -> None:
    """With tools the model may call, a stop string in its text still ends the reply there,
    and the reply names it (`stop_reason`, as vLLM does; the proxy's Messages API reports it
    as `stop_sequence`), streamed and not; a reply ended otherwise names none."""
    def short(seed: int, **extra: Any) -> dict[str, Any]:
        return {**body(seed, tools=TOOLS, **extra), "max_tokens": 40}

    for seed in SEEDS:
        free = await post(client, short(seed))
        text = free["choices"][0]["message"]["content"]
        assert "stop_reason" not in free["choices"][0]
        stop = text[6:9]
        assert len(stop) == 3 and "<tool_call>" not in text
        out = await post(client, short(seed, stop=[stop, "\x00"]))
        choice = out["choices"][0]
        assert choice["message"]["content"] == text[:text.index(stop)]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
        events = await stream(client, short(seed, stop=[stop]))
        assert streamed_text(events) == text[:text.index(stop)]
        last = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]][-1]
        assert last["choices"][0]["stop_reason"] == stop


async def test_a_stop_string_held_for_a_marker_to_the_end_ends_the_text(
        client: TestClient, generator: Generator) -> None:
    """A stop string a call's marker begins with (`<`) is held while the marker may follow;
    where the reply ends first (here: `max_tokens` 1, the one token `<`), it is a stop like
    any other: `finish_reason` stop, named, and the log-probabilities of its token not sent
    (before: `length` beside `stop_reason` `<`, and one log-probability for no text)."""
    lt = token_id(generator, "<")
    req = {**body(0, tools=TOOLS, stop=["<"], logit_bias={str(lt): 100}, logprobs=True),
           "max_tokens": 1}
    out = await post(client, req)
    choice = out["choices"][0]
    assert (choice["finish_reason"], choice.get("stop_reason")) == ("stop", "<"), choice
    assert choice["message"]["content"] == ""
    assert not (choice["logprobs"] or {}).get("content"), choice["logprobs"]
    events = await stream(client, req)
    last = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]][-1]
    assert (last["choices"][0]["finish_reason"], last["choices"][0]["stop_reason"]) == \
        ("stop", "<")
    assert not [c for e in events[:-1] if e["choices"]
                for c in ((e["choices"][0].get("logprobs") or {}).get("content") or [])]
