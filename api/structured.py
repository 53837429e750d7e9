"""Structured output, the policy shared by the proxy and the worker: what a chat request
constrains (`constraint`, from `response_format`, `tools`, `tool_choice`,
`parallel_tool_calls`), the schemas the grammar enforces, and the compile check that refuses a
schema with a 400 before the request is queued (the proxy) or run (the worker).

Semantics (docs/CLIENTS.md "Structured output"):
- every schema is enforced as `jsonschema.tighten` makes it: open objects closed, numbers
  bounded, so answers finish; what the tightened schema allows, the schema allows;
- keywords llguidance cannot enforce are ignored (its `lenient` mode, as llama.cpp skips
  them): `format`s it does not know, `uniqueItems`, `if`/`then`, `dependencies`; an
  overlapping `oneOf` is enforced as `anyOf`; a `pattern` it cannot compile (look-arounds)
  is dropped;
- a schema that still does not compile (a `$ref` to nothing, an unsatisfiable schema) is a
  400 naming the field in the API the client used (`where` maps the chat body's names).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixd.api.errors import ApiError
from prefixd.api.jsonschema import embed, tighten, without_patterns

# Compact JSON (json.dumps's separators, no other whitespace) so a model cannot loop on blank
# space; `lenient`: what cannot be enforced is ignored (and oneOf is read as anyOf)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
              "lenient": True}
Where = Callable[[str], str]


def same(param: str) -> str:
    return param


@dataclass(frozen=True)
class Constraint:
    """What the reply must be. `schema`: the JSON schema of the answer (None: free text);
    `tools`: (name, parameters schema) of the functions a call may name; `required`: a call
    must be made; `parallel`: more than one call may follow. Schemas as enforced."""

    schema: dict[str, Any] | None = None
    tools: tuple[tuple[str, dict[str, Any]], ...] = ()
    required: bool = False
    parallel: bool = True


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def constraint(response_format: dict[str, Any] | None, tools: list[dict[str, Any]] | None,
               choice: str | dict[str, Any] | None, parallel: bool | None,
               where: Where = same) -> Constraint | None:
    """The constraint of a chat request (None: free text); 400s for what cannot be enforced.
    `tools`: the tools the model sees (none for `tool_choice` none)."""
    schema = response_schema(response_format, where)
    if tools:
        return Constraint(schema=schema, **tool_constraint(tools, choice, parallel, where))
    return None if schema is None else Constraint(schema=schema)


def response_schema(fmt: dict[str, Any] | None, where: Where = same) -> dict[str, Any] | None:
    """The JSON schema `response_format` asks for, as enforced (None: free text); 400 for what
    is not one."""
    kind = (fmt or {}).get("type", "text")
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        p = where("response_format")
        raise _bad(f"'{p}' type {kind!r} is not supported (text, json_object, json_schema)", p)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        p = where("response_format.json_schema")
        raise _bad(f"'{p}' must be an object with a 'schema'", p)
    schema = spec.get("schema", {})
    p = where("response_format.json_schema.schema")
    if not isinstance(schema, dict):
        raise _bad(f"'{p}' must be a JSON schema object", p)
    return enforced(schema, p)


def tool_constraint(tools: list[dict[str, Any]], choice: str | dict[str, Any] | None,
                    parallel: bool | None, where: Where = same) -> dict[str, Any]:
    """The `Constraint` fields of the calls `tools` and `tool_choice` allow (a forced call for
    required or a named function: one call, unless `parallel_tool_calls` is true); 400 for a
    choice naming no given function or a tool schema that cannot be enforced."""
    named = None
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or not isinstance(named, str):
            raise _bad("'tool_choice' must be 'none', 'auto', 'required' or "
                       '{"type": "function", "function": {"name": ...}}', where("tool_choice"))
    elif choice not in (None, "auto", "required"):
        raise _bad("'tool_choice' must be 'none', 'auto', 'required' or a named function",
                   where("tool_choice"))
    specs: list[tuple[str, dict[str, Any]]] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") or {}
        params = fn.get("parameters")
        params = params if isinstance(params, dict) and params else {
            "type": "object", "properties": {}}
        if named is None or fn.get("name") == named:
            specs.append((str(fn.get("name")),
                          enforced(params, where(f"tools[{i}].function.parameters"))))
    if named is not None and not specs:
        raise _bad(f"'tool_choice' names {named!r}, which is not in 'tools'", where("tool_choice"))
    forced = choice == "required" or named is not None
    # a forced call is one call unless the client asks for more (llama.cpp's default): a
    # small model otherwise writes call after call until max_tokens
    return {"tools": tuple(specs), "required": forced,
            "parallel": parallel if parallel is not None else not forced}


def calls_schema(c: Constraint) -> dict[str, Any]:
    """The schema of one call's JSON, `{"name": ..., "arguments": ...}`, for any tool of `c`:
    each tool's parameters kept under `$defs`, their own `$ref`s rewritten to resolve there."""
    defs = {f"tool{i}": embed(params, f"tool{i}") for i, (_, params) in enumerate(c.tools)}
    return {"$defs": defs, "anyOf": [
        {"type": "object", "properties": {"name": {"const": name},
                                          "arguments": {"$ref": f"#/$defs/tool{i}"}},
         "required": ["name", "arguments"], "additionalProperties": False}
        for i, (name, _) in enumerate(c.tools)]}


def json_rule(schema: dict[str, Any]) -> str:
    """`schema` as a Lark `%json` rule in the compact style."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)


def compile_error(schema: dict[str, Any]) -> str:
    """llguidance's error compiling `schema` (no tokenizer needed), or ""."""
    from llguidance import LLMatcher

    try:
        # llguidance's stub types `overrides` as its own TypedDict; JSON_STYLE is that shape
        grammar = LLMatcher.grammar_from_json_schema(
            schema, overrides=JSON_STYLE)  # type: ignore[arg-type]
        error = LLMatcher.validate_grammar(grammar)
    except (ValueError, RecursionError) as e:
        error = str(e) or type(e).__name__
    return error if error and not error.startswith("WARNING") else ""


def enforced(schema: dict[str, Any], param: str) -> dict[str, Any]:
    """The schema the grammar enforces for `schema`: tightened when that compiles, else as
    given, else without the patterns llguidance cannot compile; 400 naming `param` when none
    compiles."""
    first = ""
    loose = schema
    for attempt in range(2):
        for s in (tighten(loose), loose):
            error = compile_error(s)
            if not error:
                return s
            first = first or error
        if attempt == 0:
            loose = without_patterns(schema, lambda p: bool(compile_error(
                {"type": "string", "pattern": p})))
            if loose == schema:
                break
    raise _bad(f"'{param}' is not a JSON schema prefixd can enforce: "
               f"{first.splitlines()[0][:300]}", param)


def check(c: Constraint | None, where: Where = same) -> None:
    """Compile the whole JSON part of `c` (the answer's schema, the one schema of all calls)
    as the worker will; each schema compiled alone in `constraint`, so only their sum can
    fail here (llguidance's size limits): a 400 naming `tools`."""
    if c is not None and c.tools:
        error = compile_error(calls_schema(c))
        if error:
            p = where("tools")
            raise _bad(f"'{p}' together are not a grammar prefixd can enforce: "
                       f"{error.splitlines()[0][:300]}", p)
