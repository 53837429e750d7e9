"""Request parsing and prompt building for the mlx worker.

Owns: turning an OpenAI request body into a typed `GenRequest` (every client mistake becomes an
`ApiError(400)` here, never deeper), rendering chat messages through the model's chat template,
and finding the message boundaries (token positions where each message ends) that the engine
uses as checkpoint positions. Pure functions over a tokenizer; no mlx, no I/O.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from prefixd.api.errors import ApiError
from prefixd.backends.mlx.store import common_prefix

ROLES = ("system", "developer", "user", "assistant", "tool")
# Rendering every message prefix costs O(messages x prompt). Past this many messages only the
# system prompt end and the newest boundaries are computed: older ones were placed (as
# checkpoints) by earlier turns of the same conversation already.
MAX_BOUNDARY_MESSAGES = 12


@dataclass(frozen=True)
class Sampling:
    """Decoding options. `temperature` 0 means greedy; defaults follow the OpenAI API."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None


@dataclass
class GenRequest:
    """One parsed /v1/chat/completions or /v1/completions body."""

    kind: Literal["chat", "completion"]
    model: str | None
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    prompt: str | list[int] | None = None


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    boundaries: list[int]


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


def _get(body: dict[str, Any], key: str, types: type | tuple[type, ...], what: str) -> Any:
    """body[key] if present and not null, checked against `types` (bool is never a number)."""
    value = body.get(key)
    if value is None:
        return None
    numeric = types in (int, float, (int, float))
    if (isinstance(value, bool) and numeric) or not isinstance(value, types):
        raise _bad(f"'{key}' must be {what}", key)
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(f"'{key}' must be a finite number", key)
    return value


def _number(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    value = _get(body, key, (int, float), "a number")
    if value is not None and not lo <= value <= hi:
        raise _bad(f"'{key}' must be between {lo} and {hi}", key)
    return None if value is None else float(value)


def _sampling(body: dict[str, Any]) -> Sampling:
    max_tokens = _get(body, "max_completion_tokens", int, "an integer")
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise _bad("'max_tokens' must be at least 1", "max_tokens")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    bias_in = _get(body, "logit_bias", dict, "an object of token id -> bias")
    bias = None
    if bias_in:
        try:
            bias = {int(k): float(v) for k, v in bias_in.items()}
        except (TypeError, ValueError):
            raise _bad("'logit_bias' must map token ids to numbers", "logit_bias") from None
    top_k = _get(body, "top_k", int, "an integer")
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    return Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=max(top_k or 0, 0),
        min_p=_number(body, "min_p", 0.0, 1.0) or 0.0,
        stop=tuple(s for s in stop or () if s),
        seed=_get(body, "seed", int, "an integer"),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 0.0, 10.0),
        logit_bias=bias,
    )


def parse_request(body: Any, kind: Literal["chat", "completion"]) -> GenRequest:
    """Validate a request body; raises ApiError(400) with the offending parameter named."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    n = _get(body, "n", int, "an integer")
    if n not in (None, 1):
        raise _bad("only n=1 is supported", "n")
    options = _get(body, "stream_options", dict, "an object") or {}
    req = GenRequest(kind=kind, model=_get(body, "model", str, "a string"),
                     sampling=_sampling(body),
                     stream=bool(_get(body, "stream", bool, "a boolean")),
                     include_usage=bool(_get(options, "include_usage", bool, "a boolean")))
    if kind == "completion":
        req.prompt = _completion_prompt(body.get("prompt"))
        return req
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    req.messages = [_message(i, m) for i, m in enumerate(messages)]
    tools = _get(body, "tools", list, "a list")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise _bad("'tools' must be a list of objects", "tools")
    req.tools = tools or None
    req.template_kwargs = _get(body, "chat_template_kwargs", dict, "an object") or {}
    return req


def _completion_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
        return prompt
    raise _bad("'prompt' must be a non-empty string or list of token ids", "prompt")


def _content(value: Any, param: str, required: bool) -> str:
    if value is None:
        if required:
            raise _bad(f"'{param}' is required", param)
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise _bad(f"'{param}': only text content parts are supported", param)
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"'{param}' must be a string or a list of content parts", param)


def _message(i: int, m: Any) -> dict[str, Any]:
    """A copy of one message in the shape HF chat templates expect."""
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(f"'{param}' must be an object", param)
    role = m.get("role")
    if role not in ROLES:
        raise _bad(f"'{param}.role' must be one of {', '.join(ROLES)}", f"{param}.role")
    required = role in ("system", "developer", "user")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": _content(m.get("content"), f"{param}.content", required)}
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    if role == "assistant":
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if isinstance(reasoning, str):
            out["reasoning_content"] = reasoning
        if m.get("tool_calls") is not None:
            out["tool_calls"] = _tool_calls(m["tool_calls"], f"{param}.tool_calls")
    return out


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise _bad(f"'{param}' must be a list", param)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise _bad(f"'{param}[{j}].function.name' is required", f"{param}[{j}]")
        args = fn.get("arguments")
        if isinstance(args, str):
            # Templates render arguments with `| tojson`; a string that is not JSON (a model's
            # own truncated call, sent back by the client) stays a string rather than failing.
            with contextlib.suppress(json.JSONDecodeError):
                args = json.loads(args) if args.strip() else {}
        out.append({**call, "function": {**fn, "arguments": args if args is not None else {}}})
    return out


# --- prompt building -------------------------------------------------------------------------


def render_text(tokenizer: Any, req: GenRequest, messages: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True) -> str:
    """The chat template applied to `messages` (default: all of the request's)."""
    try:
        return tokenizer.apply_chat_template(
            req.messages if messages is None else messages, tools=req.tools, tokenize=False,
            add_generation_prompt=add_generation_prompt, **req.template_kwargs)
    except Exception as e:  # jinja raise_exception(), bad kwargs: the client's input
        raise _bad(f"the chat template rejected the messages: {e}", "messages") from e


def encode(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def build_prompt(tokenizer: Any, req: GenRequest) -> Prompt:
    """The prompt token ids and (for chat) the message boundaries."""
    if req.kind == "completion":
        assert req.prompt is not None
        if isinstance(req.prompt, list):
            if max(req.prompt) >= len(tokenizer):
                raise _bad("'prompt' holds a token id outside the vocabulary", "prompt")
            return Prompt(list(req.prompt), [])
        return Prompt(encode(tokenizer, req.prompt, add_special_tokens=True), [])
    if not getattr(tokenizer, "has_chat_template", True):
        raise _bad("this model has no chat template; use /v1/completions", "messages")
    text = render_text(tokenizer, req)
    tokens = encode(tokenizer, text)
    return Prompt(tokens, message_boundaries(tokenizer, req, text, tokens))


def message_boundaries(tokenizer: Any, req: GenRequest, text: str,
                       tokens: list[int]) -> list[int]:
    """Token positions in `tokens` where messages end and where their content starts, by
    rendering message prefixes.

    The content start (after the role header, e.g. `<|im_start|>user\n`) is where a new
    conversation with a known system prompt, or the next turn, first differs. A prefix
    render is usually a string prefix of the full render; when the template renders it
    differently (e.g. reasoning kept only after the last user turn) the position where the two
    texts diverge is used instead, snapped down to a token boundary. Templates that refuse a
    prefix (e.g. "conversation must start with a user turn") just give no boundary there.
    Only the first and the newest messages are rendered: older ones are already cached.
    """
    n = len(req.messages)
    ks = list(range(1, n))
    if len(ks) > MAX_BOUNDARY_MESSAGES:
        ks = ks[:1] + ks[-(MAX_BOUNDARY_MESSAGES - 1):]
    token_ends = _token_ends(tokenizer, text, tokens)
    found: set[int] = set()
    for k in ks:
        variants = [req.messages[:k]]
        nxt = req.messages[k]
        if isinstance(nxt.get("content"), str) and nxt["content"]:
            variants.append([*req.messages[:k], {**nxt, "content": ""}])
        for messages in variants:
            try:
                prefix = render_text(tokenizer, req, messages, add_generation_prompt=False)
            except ApiError:
                continue
            chars = common_prefix(prefix, text)
            if token_ends is not None:
                pos = bisect.bisect_right(token_ends, chars)
            else:
                pos = common_prefix(encode(tokenizer, prefix[:chars]), tokens)
            if 0 < pos < len(tokens):
                found.add(pos)
    return sorted(found)


def _token_ends(tokenizer: Any, text: str, tokens: list[int]) -> list[int] | None:
    """The end character offset of each token of `text`, if the fast tokenizer gives offsets
    that match `tokens` (one tokenization instead of one per message prefix)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        enc = backend.encode(text, add_special_tokens=False)
    except Exception:
        return None
    if list(enc.ids) != tokens:
        return None
    ends = [end for _, end in enc.offsets]
    return ends if ends == sorted(ends) else None
