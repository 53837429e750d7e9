"""OpenAI Responses API (`POST /v1/responses`, Codex CLI), stateless subset -> chat body.

prefixd stores nothing: a request must carry the whole conversation in `input`
(`previous_response_id` and `item_reference` items are 400s; `store: true` is accepted and
nothing is stored). Rules:
- `instructions` -> a leading system message; `developer` messages -> `system` messages.
- message content parts (`input_text`, `output_text`, `text`, `refusal`) become one string
  joined with "\\n"; `input_image` keeps a list of parts (`image_url`).
- consecutive `function_call` items join the assistant message just before them (the text
  and calls of one turn), or start one; `function_call_output` -> a `tool` message.
- `reasoning` items -> `reasoning_content` of the next assistant message (their
  `reasoning_text` content; summaries and `encrypted_content` are dropped).
- tools: `function` -> chat function tools; a `namespace` tool (Codex's `multi_agent_v1`)
  -> one function per member named `<namespace>.<name>` (the answer splits it back into the
  `namespace` and `name` Codex routes by); other hosted types (`web_search`, `file_search`,
  `local_shell`, `custom`, ...) are dropped: a local model cannot run them.
- `reasoning.effort` none/minimal -> `enable_thinking: false`, other efforts -> true.
- `text.format` json_schema/json_object -> `response_format`.
- `prompt_cache_key` passes through (prefixd's session id), `user` too.
Accepted and ignored: `include`, `store`, `metadata`, `client_metadata`, `truncation`,
`service_tier`, `reasoning.summary`, `text.verbosity`.
"""

from __future__ import annotations

from typing import Any

from prefixd.api.values import arr
from prefixd.proxy.translate.base import (
    StreamTranslator,
    TranslateError,
    Translator,
    copy_sampling,
    stream_fields,
    want,
)
from prefixd.proxy.translate.params import responses_param
from prefixd.proxy.translate.responses_out import NAMESPACE_SEP, ResponsesStream, echo, response

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_EFFORT_OFF = ("none", "minimal")


class ResponsesTranslator(Translator):
    api = "responses"
    path = "/v1/responses"

    def request(self, body: dict) -> dict:
        if not isinstance(body, dict):
            raise TranslateError("the request body must be a JSON object")
        if body.get("previous_response_id") is not None:
            raise TranslateError("'previous_response_id' is not supported: prefixd stores no "
                                 "responses; send the whole conversation in 'input'",
                                 "previous_response_id")
        chat: dict[str, Any] = {}
        stream_fields(body, chat)
        messages: list[dict] = []
        if want(body, "instructions", str, "a string"):
            messages.append({"role": "system", "content": body["instructions"]})
        messages += _input(body.get("input"))
        chat["messages"] = messages
        _options(body, chat)
        return chat

    def response(self, chat: dict, client: dict | None = None) -> dict:
        return response(chat, echo(client or {}))

    def stream(self, client: dict | None = None) -> StreamTranslator:
        return ResponsesStream(echo(client or {}))

    def client_param(self, body: dict, param: str) -> str:
        return responses_param(body, param)

    def error_body(self, status: int, type_: str, message: str, param: str | None,
                   code: str | None) -> dict:
        return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _options(body: dict, chat: dict) -> None:
    max_tokens = want(body, "max_output_tokens", int, "an integer")
    if max_tokens is not None:
        if max_tokens < 1:
            raise TranslateError("'max_output_tokens' must be at least 1", "max_output_tokens")
        chat["max_tokens"] = max_tokens
    copy_sampling(body, chat, {"temperature": "temperature", "top_p": "top_p"})
    for key in ("prompt_cache_key", "user"):
        if want(body, key, str, "a string") is not None:
            chat[key] = body[key]
    if want(body, "parallel_tool_calls", bool, "a boolean") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("tools") is not None:
        tools = _tools(want(body, "tools", list, "a list"))
        if tools:
            chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    reasoning = want(body, "reasoning", dict, "an object")
    effort = want(reasoning, "effort", str, "a string", "reasoning.effort") if reasoning else None
    if effort is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": effort not in _EFFORT_OFF}
    text = want(body, "text", dict, "an object")
    fmt = want(text, "format", dict, "an object", "text.format") if text else None
    if fmt is not None and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}


def _function(tool: dict, where: str, prefix: str = "") -> dict:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise TranslateError(f"'{where}.name' must be a non-empty string", f"{where}.name")
    fn: dict[str, Any] = {"name": prefix + name}
    if want(tool, "description", str, "a string", f"{where}.description") is not None:
        fn["description"] = tool["description"]
    fn["parameters"] = want(tool, "parameters", dict, "an object", f"{where}.parameters") \
        or {"type": "object", "properties": {}}
    if want(tool, "strict", bool, "a boolean", f"{where}.strict") is not None:
        fn["strict"] = tool["strict"]
    return {"type": "function", "function": fn}


def _tools(tools: list) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise TranslateError(f"'{where}' must be an object", where)
        if tool.get("type") == "function":
            out.append(_function(tool, where))
        elif tool.get("type") == "namespace" and isinstance(tool.get("name"), str):
            members = arr(tool.get("tools"))
            prefix = tool["name"] + NAMESPACE_SEP
            out += [_function(m, f"{where}.tools[{j}]", prefix) for j, m in enumerate(members)
                    if isinstance(m, dict) and m.get("type") == "function"]
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools" \
            and choice.get("mode") in ("auto", "required"):
        return choice["mode"]
    raise TranslateError("'tool_choice' must be auto, none, required or a function choice",
                         "tool_choice")


def _content(content: Any, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TranslateError(f"'{where}' must be a string or a list of content parts", where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise TranslateError(f"'{where}[{j}]' has no text", f"{where}[{j}]")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise TranslateError(f"content part type {kind!r} is not supported",
                                 f"{where}[{j}].type")
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _input(items: Any) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise TranslateError("'input' must be a string or a list of items", "input")
    out: list[dict] = []
    reasoning: list[str] = []          # waiting for the next assistant message
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise TranslateError(f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise TranslateError(f"'{where}.role' must be user, assistant, system or "
                                     "developer", f"{where}.role")
            out.append({"role": role, "content": _content(item.get("content"),
                                                          f"{where}.content")})
        elif kind == "function_call":
            _attach_call(out, _call(item, where))
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _call_id(item, where),
                        "content": _output(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            parts = arr(item.get("content"))
            reasoning += [p["text"] for p in parts if isinstance(p, dict)
                          and p.get("type") == "reasoning_text" and isinstance(p.get("text"), str)]
            continue
        else:
            raise TranslateError(f"input item type {kind!r} is not supported", f"{where}.type")
        if reasoning and out[-1]["role"] == "assistant":
            prior = out[-1].get("reasoning_content")
            out[-1]["reasoning_content"] = "\n".join([prior, *reasoning] if prior else reasoning)
        reasoning = []                  # reasoning not followed by its answer is dropped
    return out


def _call_id(item: dict, where: str) -> str:
    if not isinstance(item.get("call_id"), str) or not item["call_id"]:
        raise TranslateError(f"'{where}.call_id' must be a non-empty string", f"{where}.call_id")
    return item["call_id"]


def _call(item: dict, where: str) -> dict:
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise TranslateError(f"'{where}.name' must be a non-empty string", f"{where}.name")
    if isinstance(item.get("namespace"), str) and item["namespace"]:
        name = item["namespace"] + NAMESPACE_SEP + name
    args = item.get("arguments", "")
    if not isinstance(args, str):
        raise TranslateError(f"'{where}.arguments' must be a string", f"{where}.arguments")
    return {"id": _call_id(item, where), "type": "function",
            "function": {"name": name, "arguments": args}}


def _attach_call(out: list[dict], call: dict) -> None:
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _output(output: Any, where: str) -> str:
    """A function_call_output's `output`: a string, or text parts joined."""
    if output is None:
        return ""
    content = _content(output, where)
    if not isinstance(content, str):
        raise TranslateError(f"'{where}' may only hold text", where)
    return content
