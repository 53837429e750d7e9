"""Tools for chat templates that ignore them: a Hermes/Qwen-style text fallback.

Some chat templates (SmolLM2's, the built-in default model's) render no `tools`: tool definitions
vanish, an assistant message with `tool_calls` becomes an empty turn and `tool` results are
dropped or refused. For such templates the worker rewrites the messages before rendering:

- the tool definitions go into the system prompt (a new one if there is none) as a `<tools>`
  block, with the instruction to answer `<tool_call>{"name": ..., "arguments": ...}</tool_call>`,
  the format `oai.ToolFormat()` parses from the reply;
- an assistant message's `tool_calls` become that text after its content;
- `tool` results become a user turn of `<tool_response>` blocks (consecutive results share one).

Whether a template renders tools itself is found by rendering a probe conversation with and
without a probe tool (`renders_tools`). Pure; no mlx.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

PROBE_TOOL = {"type": "function", "function": {
    "name": "prefixd_probe_tool", "description": "Probe.",
    "parameters": {"type": "object", "properties": {}}}}
PROBE_MESSAGES = [{"role": "system", "content": "Probe."}, {"role": "user", "content": "Probe."}]

TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n"
               "<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name "
               "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]


def renders_tools(render: Render) -> bool:
    """Whether the template shows tool definitions: its output changes when tools are given.
    A template that refuses the probe (raises) is taken as rendering tools itself: the worker
    then leaves its input alone, as before this fallback existed."""
    try:
        return render(PROBE_MESSAGES, [PROBE_TOOL]) != render(PROBE_MESSAGES, None)
    except Exception:
        return True


def needs_fallback(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Whether this conversation has anything tool-related to render."""
    return bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def tools_block(tools: list[dict[str, Any]]) -> str:
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_INTRO + lines + TOOLS_OUTRO


def call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    body = {"name": fn.get("name"), "arguments": fn.get("arguments", {})}
    return "<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>"


def as_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
            ) -> list[dict[str, Any]]:
    """The conversation with tools, tool calls and tool results written out as text."""
    out: list[dict[str, Any]] = []
    if tools:
        block = tools_block(tools)
        if messages and messages[0]["role"] == "system":
            first = messages[0]
            out.append({**first, "content": (first["content"] + "\n\n" if first["content"]
                                             else "") + block})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in messages:
        if m["role"] == "tool":
            text = "<tool_response>\n" + m["content"] + "\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text, "_tool_results": True})
        elif m.get("tool_calls"):
            calls = "\n".join(call_text(c) for c in m["tool_calls"])
            rest = {k: v for k, v in m.items() if k != "tool_calls"}
            out.append({**rest, "content": (m["content"] + "\n" if m["content"] else "") + calls})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
