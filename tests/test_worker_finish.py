"""Constrained answers that finish and are honest, on the real worker app with a tiny
random-weight Qwen3 (its free output is garbage: only the grammar shapes it). A bias toward
`"` keeps its strings short, as a trained model's are; what is left to wander is the schema's
openness, which the grammar must close:

- real-world schemas (pydantic `$defs`, zod `definitions`, Kubernetes-ish, a function tool's
  parameters) that leave objects open and integers unbounded finish within a modest
  `max_tokens` and validate (before: keys declared nowhere, keys repeated, long integers, cut
  by the length limit);
- keywords a grammar cannot enforce (annotation `format`s, `uniqueItems`, `if`, `dependencies`,
  an overlapping `oneOf`) are ignored, as llama.cpp does (before: a 400);
- a tool whose parameters use `$defs`/`$ref` works for every `tool_choice` (before: a 500);
- a forced call cut by `max_tokens` is `length`, with no call markup in the text (before:
  `tool_calls`, and the cut call leaked as text)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from real_schemas import KUBE_DEPLOYMENT, PYDANTIC_ORDER, UNENFORCEABLE, WEATHER_PARAMS, ZOD_EVENT
from schema_check import violation
from test_worker_structured import json_schema, token_id
from worker_fixtures import chat, post

from prefixd.backends.mlx.scheduler.generator import Generator

REAL = {"pydantic": PYDANTIC_ORDER, "zod": ZOD_EVENT, "kube": KUBE_DEPLOYMENT,
        "function": WEATHER_PARAMS}
# closed already: only its numbers can run on
READING = {"type": "object", "properties": {"count": {"type": "integer"},
                                            "level": {"type": "number"}},
           "required": ["count", "level"], "additionalProperties": False}
SEEDS = range(3)
MAX_TOKENS = 256  # the tiny model writes a digit per token, up to 16 of them


def tool(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def short_strings(generator: Generator) -> dict[str, float]:
    return {str(token_id(generator, '"')): 100}


def go_on(generator: Generator) -> dict[str, float]:
    """Short strings, and a strong pull toward `,` (one more key or item) and digits."""
    return {**short_strings(generator), str(token_id(generator, ",")): 50,
            **{str(token_id(generator, d)): 40 for d in "123456789"}}


def body(seed: int, generator: Generator, **extra: Any) -> dict[str, Any]:
    return chat(**{"temperature": 1.0, "seed": seed, "max_tokens": MAX_TOKENS,
                   "logit_bias": short_strings(generator), **extra})


def digits(value: Any) -> int:
    """The most digits of any integer in `value`."""
    if isinstance(value, dict):
        return max((digits(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return max((digits(v) for v in value), default=0)
    return len(str(abs(value))) if isinstance(value, int) and not isinstance(value, bool) else 0


@pytest.mark.parametrize("name", REAL)
async def test_open_real_world_schemas_finish_and_validate(client: TestClient,
                                                           generator: Generator,
                                                           name: str) -> None:
    schema = REAL[name]
    for seed in SEEDS:
        out = await post(client, body(seed, generator, response_format=json_schema(schema)))
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", (seed, choice)
        value = json.loads(choice["message"]["content"])
        assert violation(value, schema) is None, (seed, value)
        assert digits(value) <= 16, value


@pytest.mark.parametrize("name", UNENFORCEABLE)
async def test_keywords_a_grammar_cannot_enforce_are_ignored(client: TestClient,
                                                             generator: Generator,
                                                             name: str) -> None:
    schema = UNENFORCEABLE[name]
    resp = await client.post("/v1/chat/completions", json=body(
        0, generator, response_format=json_schema(schema)))
    assert resp.status == 200, await resp.text()
    choice = (await resp.json())["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert violation(json.loads(choice["message"]["content"]), schema) is None


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
async def test_tool_parameters_with_defs_and_refs(client: TestClient, generator: Generator,
                                                  choice: str) -> None:
    """pydantic's `$defs`/`$ref` in a tool's parameters resolve inside the one schema of all
    calls, for every `tool_choice`."""
    tools = [tool("place_order", PYDANTIC_ORDER), tool("weather", WEATHER_PARAMS)]
    tool_choice: Any = {"type": "function", "function": {"name": "place_order"}} \
        if choice == "named" else choice
    for seed in SEEDS:
        resp = await client.post("/v1/chat/completions", json=body(
            seed, generator, tools=tools, tool_choice=tool_choice, parallel_tool_calls=False))
        assert resp.status == 200, await resp.text()
        out = (await resp.json())["choices"][0]
        if choice == "auto":
            continue                    # free text, or a call: either is fine
        assert out["finish_reason"] == "tool_calls", out
        [call] = out["message"]["tool_calls"]
        fn = call["function"]
        params = {"place_order": PYDANTIC_ORDER, "weather": WEATHER_PARAMS}[fn["name"]]
        assert violation(json.loads(fn["arguments"]), params) is None, fn
        assert choice != "named" or fn["name"] == "place_order"


async def test_forced_calls_on_open_parameters_finish(client: TestClient,
                                                      generator: Generator) -> None:
    for seed in SEEDS:
        out = await post(client, body(seed, generator, tools=[tool("weather", WEATHER_PARAMS)],
                                      tool_choice="required", parallel_tool_calls=False,
                                      logit_bias=go_on(generator)))
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls", (seed, choice)
        args = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
        assert violation(args, WEATHER_PARAMS) is None and digits(args) <= 16, args


async def test_a_forced_call_cut_by_max_tokens_is_length(client: TestClient,
                                                         generator: Generator) -> None:
    """One whole call, then a second one cut by `max_tokens` (a bias toward a new line and
    `<tool_call>` opens it): the reply is `length`, never a finished call, and the cut call
    is not text."""
    bias = {**short_strings(generator), str(token_id(generator, "<tool_call>")): 30,
            str(token_id(generator, "\n")): 30}
    req = chat(temperature=0, max_tokens=MAX_TOKENS, logit_bias=bias,
               tools=[tool("weather", WEATHER_PARAMS)], tool_choice="required")
    one = await post(client, {**req, "parallel_tool_calls": False})
    assert one["choices"][0]["finish_reason"] == "tool_calls"
    first = one["usage"]["completion_tokens"]
    cut = await post(client, {**req, "max_tokens": first + 6, "parallel_tool_calls": True})
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "length", choice
    assert "<tool_call>" not in (choice["message"]["content"] or ""), choice
    assert "tool_call>" not in json.dumps(choice["message"].get("tool_calls") or [])


@pytest.mark.parametrize("name", ["kube", "function", "pydantic", "reading"])
async def test_a_model_that_would_go_on_still_finishes(client: TestClient,
                                                       generator: Generator,
                                                       name: str) -> None:
    """A model pushed to go on wherever the grammar lets it (`go_on`): open objects let it add
    keys declared nowhere (or one key again) and numbers let it add digits forever (the
    length limit, every time); closed objects and bounded numbers end it."""
    schema = READING if name == "reading" else REAL[name]
    for seed in SEEDS:
        out = await post(client, body(seed, generator, response_format=json_schema(schema),
                                      logit_bias=go_on(generator)))
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", (seed, choice)
        value = json.loads(choice["message"]["content"])
        assert violation(value, schema) is None and digits(value) <= 16, value


async def test_a_call_repeated_exactly_ends_the_reply(client: TestClient,
                                                      generator: Generator) -> None:
    """A model pushed to go on after each call (a new line and `<tool_call>`), whose calls can
    only be the same one: the reply ends at the first repeat, which is dropped (before: the
    same call again and again until the length limit)."""
    clock = tool("clock", {"type": "object", "properties": {"zone": {"enum": ["utc"]}},
                           "required": ["zone"]})
    bias = {str(token_id(generator, "<tool_call>")): 30, str(token_id(generator, "\n")): 30}
    for seed in SEEDS:
        out = await post(client, body(seed, generator, tools=[clock], tool_choice="required",
                                      parallel_tool_calls=True, logit_bias=bias))
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == [
            '{"zone": "utc"}']
        assert out["usage"]["completion_tokens"] < MAX_TOKENS


async def test_a_tool_schema_with_its_own_id(client: TestClient, generator: Generator) -> None:
    """A tool's parameters that name themselves (`id`/`$id`, as schemastore files do) with refs
    into their own `definitions` still resolve inside the calls' schema (before: a 500, the
    refs read as the named document, which is nowhere)."""
    params = {"id": "https://example.com/schemas/config.json#",
              "$schema": "http://json-schema.org/draft-04/schema#",
              "definitions": {"mode": {"enum": ["fast", "safe"]}},
              "type": "object", "properties": {"mode": {"$ref": "#/definitions/mode"}},
              "required": ["mode"]}
    out = await post(client, body(0, generator, tools=[tool("configure", params)],
                                  tool_choice="required", parallel_tool_calls=False))
    [call] = out["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["mode"] in ("fast", "safe")


@pytest.mark.parametrize("parallel", [None, True])
async def test_a_forced_call_is_one_call_unless_more_are_asked_for(
        client: TestClient, generator: Generator, parallel: bool | None) -> None:
    """`tool_choice` required without `parallel_tool_calls`: one call, as llama.cpp (before:
    a model pushed to go on wrote call after call until the length limit); with
    `parallel_tool_calls: true`, more may follow."""
    bias = {**short_strings(generator), str(token_id(generator, "<tool_call>")): 30,
            str(token_id(generator, "\n")): 30}
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    out = await post(client, body(0, generator, logit_bias=bias, tools=[
        tool("weather", WEATHER_PARAMS)], tool_choice="required", **extra))
    choice = out["choices"][0]
    if parallel is None:
        assert choice["finish_reason"] == "tool_calls", choice
        assert len(choice["message"]["tool_calls"]) == 1
    else:
        assert len(choice["message"]["tool_calls"]) > 1, choice
