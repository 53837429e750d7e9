"""Parse a client's body once, at the edge, into a typed `ClientRequest`.

Only the fields prefixd acts on are checked (types of the known OpenAI fields); everything
else passes through untouched. A client mistake raises `ApiError(400, ...)` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from prefixd.api.errors import ApiError

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

_NUMBER = (int, float)
# field -> (accepted types, description); bool is excluded from numbers explicitly below
_KNOWN: dict[str, tuple[tuple[type, ...], str]] = {
    "model": ((str,), "a string"),
    "stream": ((bool,), "a boolean"),
    "max_tokens": ((int,), "an integer"),
    "max_completion_tokens": ((int,), "an integer"),
    "n": ((int,), "an integer"),
    "temperature": (_NUMBER, "a number"),
    "top_p": (_NUMBER, "a number"),
    "presence_penalty": (_NUMBER, "a number"),
    "frequency_penalty": (_NUMBER, "a number"),
    "seed": ((int,), "an integer"),
    "stop": ((str, list), "a string or a list of strings"),
    "stream_options": ((dict,), "an object"),
    "tools": ((list,), "a list"),
    "user": ((str,), "a string"),
    "prompt_cache_key": ((str,), "a string"),
    "metadata": ((dict,), "an object"),
}


@dataclass(frozen=True)
class ClientRequest:
    path: str
    raw: bytes                # the client's bytes, forwarded as-is unless a stage changes the body
    body: dict[str, Any]
    model: str | None
    stream: bool
    wants_usage: bool         # the client itself asked for usage on its stream


def _check_type(body: dict[str, Any], key: str) -> None:
    if key not in body or body[key] is None:
        return
    types, what = _KNOWN[key]
    value = body[key]
    if isinstance(value, bool) and bool not in types:
        raise ApiError(400, f"'{key}' must be {what}", param=key, code="invalid_type")
    if not isinstance(value, types):
        raise ApiError(400, f"'{key}' must be {what}", param=key, code="invalid_type")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of message objects",
                       param="messages", code="invalid_type")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", param=f"messages[{i}]",
                           code="invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"messages[{i}].role must be a non-empty string",
                           param=f"messages[{i}].role", code="invalid_type")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ApiError(400, f"messages[{i}].content must be a string, a list of parts or null",
                           param=f"messages[{i}].content", code="invalid_type")
        if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
            raise ApiError(400, f"messages[{i}].content parts must be objects",
                           param=f"messages[{i}].content", code="invalid_type")


def _check_prompt(prompt: Any) -> None:
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt
        and (all(isinstance(p, str) for p in prompt)
             or all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)))
    if not ok:
        raise ApiError(400, "'prompt' must be a string, a list of strings or a list of token ids",
                       param="prompt", code="invalid_type")


def parse(path: str, raw: bytes) -> ClientRequest:
    """Validate `raw` for `path`; raise ApiError(400) on the first problem found."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_body")
    for key in _KNOWN:
        _check_type(body, key)
    if isinstance(body.get("stop"), list) and not all(isinstance(s, str) for s in body["stop"]):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop",
                       code="invalid_type")
    for key in ("max_tokens", "max_completion_tokens", "n"):
        if isinstance(body.get(key), int) and body[key] < (0 if key != "n" else 1):
            raise ApiError(400, f"'{key}' is out of range", param=key, code="invalid_value")
    if path == CHAT_PATH:
        if "messages" not in body:
            raise ApiError(400, "'messages' is required", param="messages", code="missing_field")
        _check_messages(body["messages"])
    else:
        if "prompt" not in body:
            raise ApiError(400, "'prompt' is required", param="prompt", code="missing_field")
        _check_prompt(body["prompt"])
    opts = body.get("stream_options") or {}
    return ClientRequest(path=path, raw=raw, body=body, model=body.get("model"),
                         stream=bool(body.get("stream")),
                         wants_usage=bool(opts.get("include_usage")))


def with_stream_usage(raw: bytes, body: dict[str, Any]) -> bytes:
    """The same request asking the upstream for stream usage, other bytes untouched.

    The key is spliced in after the opening brace so the rest of the client's bytes (and any
    prefix-cache-relevant ordering) are forwarded exactly as sent."""
    if "stream_options" in body:
        opts = dict(body["stream_options"] or {})
        opts["include_usage"] = True
        return json.dumps({**body, "stream_options": opts}).encode()
    start = raw.index(b"{") + 1
    sep = b"," if body else b""
    return raw[:start] + b'"stream_options":{"include_usage":true}' + sep + raw[start:]
