"""Anthropic Messages API (`POST /v1/messages`, Claude Code) -> chat completions body.

Rules that keep re-rendered history byte-identical (prefix caching depends on them):
- text-only content (the `system` blocks, a message's text blocks, a tool result's text
  blocks) becomes one string, blocks joined with "\\n"; content with images stays a list of
  parts (text parts and `image_url` parts with data URLs). `cache_control` is dropped.
- `tool_use.input` becomes `arguments = json.dumps(input, ensure_ascii=False)` (the separators
  of Hugging Face chat templates' `tojson`, what most local models were trained to emit).
- a user message with `tool_result` blocks becomes the `tool` messages first, then one user
  message with its other blocks (and any images the tool results held), in order.
- `is_error: true` tool results get the marker "Error: " before their text.
- `thinking` blocks in assistant history -> `reasoning_content` (joined with "\\n");
  `redacted_thinking` blocks are dropped (nothing readable in them).
- a `system` message inside `messages` (Claude Code sends one) stays a `system` message there.
- server tools (a `type` other than `custom`, e.g. `web_search_20250305`) are dropped: only
  client tools can run against a local model.
- `output_config.format` (or the older top-level `output_format`), `{"type": "json_schema",
  "schema": {...}}` (Claude Code's session-title call sends one) -> `response_format`
  `json_schema` (named "output"), which a prefixd worker enforces with its grammar.
Ignored fields: `context_management`, `output_config.effort`, `service_tier`, `container`,
`mcp_servers`.
"""

from __future__ import annotations

import json
from typing import Any

from prefixd.proxy.translate.anthropic_out import AnthropicStream, message
from prefixd.proxy.translate.base import (
    StreamTranslator,
    TranslateError,
    Translator,
    copy_sampling,
    stream_fields,
    want,
)
from prefixd.proxy.translate.params import anthropic_param

_ROLES = ("user", "assistant", "system")
_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}
_THINKING = {"enabled": True, "adaptive": True, "disabled": False}
# Anthropic error type by status; other 4xx: invalid_request_error, other 5xx: api_error
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error",
                504: "timeout_error"}


class AnthropicTranslator(Translator):
    api = "anthropic"
    path = "/v1/messages"

    def request(self, body: dict) -> dict:
        return _chat_body(body, count_only=False)

    def response(self, chat: dict, client: dict | None = None) -> dict:
        return message(chat)

    def stream(self, client: dict | None = None) -> StreamTranslator:
        return AnthropicStream()

    def client_param(self, body: dict, param: str) -> str:
        return anthropic_param(body, param)

    def error_body(self, status: int, type_: str, message: str, param: str | None,
                   code: str | None) -> dict:
        kind = _ERROR_TYPES.get(status) or ("api_error" if status >= 500
                                             else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}


def count_tokens_request(body: dict) -> dict:
    """`POST /v1/messages/count_tokens` body -> the chat body whose prompt the pipeline counts
    (`max_tokens` not required, never a stream)."""
    return _chat_body(body, count_only=True)


def _chat_body(body: Any, count_only: bool) -> dict:
    if not isinstance(body, dict):
        raise TranslateError("the request body must be a JSON object")
    chat: dict[str, Any] = {}
    if count_only:
        if "model" in body:
            chat["model"] = want(body, "model", str, "a string")
    else:
        stream_fields(body, chat)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise TranslateError("'messages' must be a non-empty list", "messages")
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text(body["system"], "system")})
    for i, m in enumerate(raw):
        messages += _message(m, f"messages.{i}")
    chat["messages"] = messages
    max_tokens = want(body, "max_tokens", int, "an integer")
    if max_tokens is None and not count_only:
        raise TranslateError("'max_tokens' is required", "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise TranslateError("'max_tokens' must be at least 1", "max_tokens")
    if max_tokens is not None and not count_only:
        chat["max_tokens"] = max_tokens
    _options(body, chat)
    return chat


def _options(body: dict, chat: dict) -> None:
    stops = want(body, "stop_sequences", list, "a list of strings")
    if stops is not None:
        if not all(isinstance(s, str) for s in stops):
            raise TranslateError("'stop_sequences' must be a list of strings", "stop_sequences")
        chat["stop"] = stops
    copy_sampling(body, chat, {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"})
    metadata = want(body, "metadata", dict, "an object")
    if metadata is not None and want(metadata, "user_id", str, "a string",
                                     "metadata.user_id") is not None:
        chat["user"] = metadata["user_id"]
    if body.get("tools") is not None:
        tools = _tools(want(body, "tools", list, "a list"))
        if tools:
            chat["tools"] = tools
    if body.get("tool_choice") is not None:
        _tool_choice(want(body, "tool_choice", dict, "an object"), chat)
    _output_format(body, chat)
    thinking = want(body, "thinking", dict, "an object")
    if thinking is not None:
        if thinking.get("type") not in _THINKING:
            raise TranslateError("'thinking.type' must be enabled, adaptive or disabled",
                                 "thinking.type")
        chat["chat_template_kwargs"] = {"enable_thinking": _THINKING[thinking["type"]]}


def _output_format(body: dict, chat: dict) -> None:
    """`output_config.format` (or the beta's top-level `output_format`) -> `response_format`."""
    config = want(body, "output_config", dict, "an object")
    param = "output_config.format"
    fmt = want(config, "format", dict, "an object", param) if config else None
    if fmt is None:
        param = "output_format"
        fmt = want(body, "output_format", dict, "an object")
    if fmt is None:
        return
    if fmt.get("type") != "json_schema":
        raise TranslateError(f"'{param}.type' must be json_schema", f"{param}.type")
    schema = want(fmt, "schema", dict, "an object", f"{param}.schema")
    if schema is None:
        raise TranslateError(f"'{param}.schema' is required", f"{param}.schema")
    chat["response_format"] = {"type": "json_schema", "json_schema": {
        "name": "output", "schema": schema, "strict": True}}


def _tools(tools: list) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise TranslateError(f"'{where}' must be an object", where)
        if tool.get("type") not in (None, "custom"):
            continue                        # a server tool: runs at Anthropic only
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise TranslateError(f"'{where}.name' must be a non-empty string", f"{where}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise TranslateError(f"'{where}.input_schema' must be an object",
                                 f"{where}.input_schema")
        fn: dict[str, Any] = {"name": tool["name"]}
        if want(tool, "description", str, "a string", f"{where}.description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict, chat: dict) -> None:
    kind = choice.get("type")
    if kind in _TOOL_CHOICE:
        chat["tool_choice"] = _TOOL_CHOICE[kind]
    elif kind == "tool":
        name = want(choice, "name", str, "a string", "tool_choice.name")
        if not name:
            raise TranslateError("'tool_choice.name' is required", "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise TranslateError("'tool_choice.type' must be auto, any, tool or none",
                             "tool_choice.type")
    if want(choice, "disable_parallel_tool_use", bool, "a boolean",
            "tool_choice.disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _blocks(content: Any, where: str) -> list[dict]:
    """The content blocks of a message (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise TranslateError(f"'{where}' must be a string or a list of content blocks", where)
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise TranslateError(f"'{where}.{j}' must be an object", f"{where}.{j}")
        if block.get("type") == "text" and not isinstance(block.get("text"), str):
            raise TranslateError(f"'{where}.{j}.text' must be a string", f"{where}.{j}.text")
    return content


def _text(content: Any, where: str) -> str:
    """Text-only content (system, a system message) as one string."""
    blocks = _blocks(content, where)
    for j, block in enumerate(blocks):
        if block.get("type") != "text":
            raise TranslateError(f"'{where}.{j}.type' must be text", f"{where}.{j}.type")
    return "\n".join(b["text"] for b in blocks)


def _joined(parts: list[dict]) -> str | list[dict]:
    """Chat content: one string when every part is text, else the list of parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _image(block: dict, where: str) -> dict:
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" \
            and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif isinstance(source, dict) and source.get("type") == "url" \
            and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise TranslateError(f"'{where}.source' must be a base64 or url image source",
                             f"{where}.source")
    return {"type": "image_url", "image_url": {"url": url}}


def _part(block: dict, where: str) -> dict:
    """A user-side text, image or text document block -> a chat content part."""
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "text": block["text"]}
    if kind == "image":
        return _image(block, where)
    source = block.get("source")
    if kind == "document" and isinstance(source, dict) and source.get("type") == "text" \
            and isinstance(source.get("data"), str):
        return {"type": "text", "text": source["data"]}
    raise TranslateError(f"content block type {kind!r} is not supported here", f"{where}.type")


def _message(m: Any, where: str) -> list[dict]:
    if not isinstance(m, dict):
        raise TranslateError(f"'{where}' must be an object", where)
    role = m.get("role")
    if role not in _ROLES:
        raise TranslateError(f"'{where}.role' must be user, assistant or system", f"{where}.role")
    if role == "system":
        return [{"role": "system", "content": _text(m.get("content"), f"{where}.content")}]
    blocks = _blocks(m.get("content"), f"{where}.content")
    if role == "assistant":
        return [_assistant(blocks, f"{where}.content")]
    tools: list[dict] = []
    parts: list[dict] = []
    for j, block in enumerate(blocks):
        if block.get("type") == "tool_result":
            tools.append(_tool_result(block, f"{where}.content.{j}", parts))
        else:
            parts.append(_part(block, f"{where}.content.{j}"))
    if parts or not tools:
        tools.append({"role": "user", "content": _joined(parts)})
    return tools


def _tool_result(block: dict, where: str, images: list[dict]) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise TranslateError(f"'{where}.tool_use_id' must be a non-empty string",
                             f"{where}.tool_use_id")
    content = block.get("content")
    texts = []
    for k, inner in enumerate(_blocks("" if content is None else content, f"{where}.content")):
        part = _part(inner, f"{where}.content.{k}")
        if part["type"] == "text":
            texts.append(part["text"])
        else:
            images.append(part)
    text = "\n".join(texts)
    if block.get("is_error") is True:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _assistant(blocks: list[dict], where: str) -> dict:
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            texts.append(block["text"])
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(_tool_call(block, f"{where}.{j}"))
        elif kind != "redacted_thinking":
            raise TranslateError(f"content block type {kind!r} is not supported in an "
                                 "assistant message", f"{where}.{j}.type")
    msg: dict[str, Any] = {"role": "assistant",
                           "content": "\n".join(texts) if texts or not calls else None}
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tool_call(block: dict, where: str) -> dict:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise TranslateError(f"'{where}.{key}' must be a non-empty string", f"{where}.{key}")
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise TranslateError(f"'{where}.input' must be an object", f"{where}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(args, ensure_ascii=False)}}
