"""Structured output, the request side: what a request constrains (`Constraint`, from
`response_format`, `tools`, `tool_choice` and `parallel_tool_calls`) and the llguidance Lark
grammar that enforces it (`lark`).

- `response_format` `json_schema` (its `schema`; `strict` or not, the schema is enforced) or
  `json_object` (any JSON object): the reply is that JSON, and nothing else.
- `tool_choice` `"required"` or a named function: the reply is one or more tool calls (only the
  named one), each `{"name": ..., "arguments": <that tool's parameters>}` between the model's
  tool-call markers, exactly what `oai.extract_tool_calls` parses.
- tools with `tool_choice` `"auto"` (or absent): free text until the model writes the tool-call
  opening marker, then the same call grammar (llama.cpp's lazy grammar); with a
  `response_format` as well, the JSON or calls.

JSON is written with `json.dumps`'s separators (", ", ": ") and no other whitespace, so a model
cannot loop on blank space. Only tool-call formats whose body is that JSON (Qwen/Hermes
`<tool_call>`, mlx-lm's `json_tools`) are constrained; other formats stay free. Pure: llguidance
only builds and checks grammar text here; `grammar_run.py` runs it on tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixd.api.errors import ApiError

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What the reply must be. `schema`: the JSON schema of the answer (None: free text);
    `tools`: (name, parameters schema) of the functions a call may name; `required`: a call
    must be made; `parallel`: more than one call may follow."""

    schema: dict[str, Any] | None = None
    tools: tuple[tuple[str, dict[str, Any]], ...] = ()
    required: bool = False
    parallel: bool = True


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def response_schema(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema `response_format` asks for (None: free text); 400 for what is not one."""
    kind = (fmt or {}).get("type", "text")
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise _bad(f"response_format type {kind!r} is not supported (text, json_object, "
                   "json_schema)", "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("'response_format.json_schema' must be an object with a 'schema'",
                   "response_format.json_schema")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _bad("'response_format.json_schema.schema' must be a JSON schema object",
                   "response_format.json_schema.schema")
    _check_schema(schema, "response_format.json_schema.schema")
    return schema


def tool_constraint(tools: list[dict[str, Any]], choice: str | dict[str, Any] | None,
                    parallel: bool | None) -> Constraint:
    """The calls `tools` and `tool_choice` allow (a forced call for required or a named
    function); 400 for a choice naming no given function or a tool schema llguidance rejects."""
    named = None
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or not isinstance(named, str):
            raise _bad("'tool_choice' must be 'none', 'auto', 'required' or "
                       '{"type": "function", "function": {"name": ...}}', "tool_choice")
    elif choice not in (None, "auto", "required"):
        raise _bad("'tool_choice' must be 'none', 'auto', 'required' or a named function",
                   "tool_choice")
    specs: list[tuple[str, dict[str, Any]]] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") or {}
        params = fn.get("parameters")
        params = params if isinstance(params, dict) and params else {"type": "object"}
        if named is None or fn.get("name") == named:
            _check_schema(params, f"tools[{i}].function.parameters")
            specs.append((str(fn.get("name")), params))
    if named is not None and not specs:
        raise _bad(f"'tool_choice' names {named!r}, which is not in 'tools'", "tool_choice")
    return Constraint(tools=tuple(specs), required=choice == "required" or named is not None,
                      parallel=parallel is not False)


def _check_schema(schema: dict[str, Any], param: str) -> None:
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(_json_grammar(schema))
    except ValueError as e:
        error = str(e)
    if error:
        raise _bad(f"'{param}' is not a JSON schema this worker can enforce: "
                   f"{error.splitlines()[0]}", param)


def _json_grammar(schema: dict[str, Any]) -> str:
    from llguidance import LLMatcher

    # llguidance's stub types `overrides` as its own TypedDict; JSON_STYLE is that shape
    return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)  # type: ignore[arg-type]


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)


def _regex(text: str) -> str:
    return re.escape(text).replace("/", "\\/")


@dataclass(frozen=True)
class Markers:
    """The model's tool-call markers (None: its calls are not JSON, so not constrained), and
    the end of thinking when the prompt leaves a think block open."""

    call: tuple[str, str] | None = ("<tool_call>", "</tool_call>")
    think_end: str | None = None


def lark(c: Constraint, markers: Markers, token: Callable[[str], str]) -> str | None:
    """The Lark grammar of `c` (None: nothing to enforce). `token(text)` is how a marker is
    written in the grammar: the special token that spells it, or the text itself."""
    call = markers.call if c.tools else None
    rules = ["%llguidance {}"]
    if call is not None:
        body = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}
            for name, params in c.tools]}
        more = ' ("\\n" call)*' if c.parallel else ""
        start, end = token(call[0]), token(call[1])
        rules += [f'calls: call{more}', f'call: {start} rest',
                  f'rest: "\\n" {_json(body)} "\\n" {end}']
    if call is not None and c.required:
        answer = "calls"
    elif call is not None and c.schema is not None:
        answer = f"{_json(c.schema)} | calls"
    elif call is not None:
        answer = f'TEXT | TEXT {token(call[0])} rest{more}'
        rules.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*{_regex(call[0])}.*)/")
    elif c.schema is not None:
        answer = _json(c.schema)
    else:
        return None
    rules.append(f"answer: {answer}")
    if markers.think_end is None:
        rules.append("start: answer")
    else:  # the reasoning, free, then the answer after blank lines
        rules += [f"start: THOUGHT {token(markers.think_end)} /[ \\n]{{0,3}}/ answer",
                  f"THOUGHT: /(?s:.*)/ & ~/(?s:.*{_regex(markers.think_end)}.*)/"]
    return "\n".join(rules) + "\n"
