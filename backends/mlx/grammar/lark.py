"""Structured output, the worker's grammar: the llguidance Lark grammar (`lark`) that
enforces a request's `Constraint` (`prefixd.api.structured`: what a request constrains, the
schemas as enforced, and their 400s, shared with the proxy).

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
`<tool_call>`, mlx-lm's `json_tools`) are constrained; other formats stay free. Pure: no
llguidance here; `grammar/matcher.py` runs the grammar on tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from prefixd.api.structured import Constraint, calls_schema, json_rule


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
        more = ' ("\\n" call)*' if c.parallel else ""
        start, end = token(call[0]), token(call[1])
        rules += [f'calls: call{more}', f'call: {start} rest',
                  f'rest: "\\n" {json_rule(calls_schema(c))} "\\n" {end}']
    if call is not None and c.required:
        answer = "calls"
    elif call is not None and c.schema is not None:
        answer = f"{json_rule(c.schema)} | calls"
    elif call is not None:
        answer = f'TEXT | TEXT {token(call[0])} rest{more}'
        rules.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*{_regex(call[0])}.*)/")
    elif c.schema is not None:
        answer = json_rule(c.schema)
    else:
        return None
    rules.append(f"answer: {answer}")
    if markers.think_end is None:
        rules.append("start: answer")
    else:  # the reasoning, free, then the answer after blank lines
        rules += [f"start: THOUGHT {token(markers.think_end)} /[ \\n]{{0,3}}/ answer",
                  f"THOUGHT: /(?s:.*)/ & ~/(?s:.*{_regex(markers.think_end)}.*)/"]
    return "\n".join(rules) + "\n"
