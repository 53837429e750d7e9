"""The request schema of /v1/chat/completions and /v1/completions, shared by the proxy and the
worker so both accept and refuse exactly the same bodies, with the same 400s.

`parse_body(kind, raw)` reads the client's bytes once: JSON, then the typed model. Unknown
fields are allowed (and pass through the proxy untouched); the known ones are checked strictly
(no "5" for 5, no true for 1, no NaN). A body the schema accepts may still name something a
particular backend cannot do (the worker: image parts, n > 1): that is the backend's 400.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from prefixd.api.errors import ApiError

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 4096           # a 128K-token context holds far fewer real messages
MAX_STOP = 16
INT64 = (-(2**63), 2**63 - 1)
Kind = Literal["chat", "completion"]

_CONFIG = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
Number = Annotated[float, Field(allow_inf_nan=False)]
# A request's cache partition, from the proxy to a prefixd worker (PREFIXD_CACHE_ISOLATION)
NAMESPACE_HEADER = "X-Prefixd-Cache-Namespace"
_NAMESPACE = re.compile(r"^[0-9a-f]{1,64}$")


def cache_namespace(headers: Any) -> str:
    """The cache partition a request names (`NAMESPACE_HEADER`: lowercase hex), or "" (the
    shared one); 400 for anything else."""
    value = headers.get(NAMESPACE_HEADER, "")
    if value and not _NAMESPACE.match(value):
        raise ApiError(400, f"{NAMESPACE_HEADER} must be 1-64 lowercase hex digits",
                       code="invalid_namespace")
    return str(value)


class ContentPart(BaseModel):
    model_config = _CONFIG
    type: Annotated[str, Field(min_length=1)]
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = _CONFIG
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(BaseModel):
    model_config = _CONFIG
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = _CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> Message:
        if self.content is None and self.role in ("system", "developer", "user"):
            raise ValueError("content is required for this role")
        return self

    def text(self) -> str | None:
        """The content as one string when every part is text; None otherwise."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if all(p.type == "text" and p.text is not None for p in self.content):
            return "".join(p.text or "" for p in self.content)
        return None


class FunctionDef(BaseModel):
    model_config = _CONFIG
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = _CONFIG
    type: str = "function"
    function: FunctionDef | None = None


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: bool | None = None


class _Common(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    seed: Annotated[int, Field(ge=INT64[0], le=INT64[1])] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    logprobs: bool | int | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stop if s)

    @property
    def wants_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Common):
    prompt: (Annotated[str, Field(min_length=1)] | TokenIds
             | Annotated[list[str], Field(min_length=1, max_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=1)])
    echo: bool | None = None
    suffix: str | None = None

    @property
    def text_or_ids(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return p[0]  # a batch of one
        return p  # type: ignore[return-value]  # token ids: mypy cannot narrow a list by its items


Request = ChatRequest | CompletionRequest


@dataclass(frozen=True)
class Parsed:
    """A client's body read once: its bytes, the dict they decode to, the typed view."""

    kind: Kind
    raw: bytes
    body: dict[str, Any]
    req: Request


# A JSON \u escape of a UTF-16 surrogate: valid JSON, but not text (cannot be encoded).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def decode_json(raw: bytes) -> Any:
    """JSON bytes (UTF-8) -> Python value; ApiError(400) otherwise."""
    try:
        text = raw.decode("utf-8")
        value = json.loads(text)
    except UnicodeDecodeError:
        raise ApiError(400, "request body must be UTF-8 encoded JSON",
                       code="invalid_json") from None
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if _SURROGATE.search(raw):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "request body holds a lone UTF-16 surrogate (\\ud800-\\udfff) "
                           "that is not text", code="invalid_json") from None
    return value


def parse_body(kind: Kind, raw: bytes) -> Parsed:
    """Validate `raw` as a `kind` request; ApiError(400) naming the first bad field."""
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_body")
    return Parsed(kind, raw, body, validate(kind, body))


def validate(kind: Kind, body: dict[str, Any]) -> Request:
    model = ChatRequest if kind == "chat" else CompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _error(e, body) from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_body") from None


def param_path(loc: tuple[int | str, ...], body: Any, missing: bool = False) -> str:
    """`messages[3].content` from a pydantic location, skipping union-branch tags (loc parts
    that are not keys or indexes of the body)."""
    out, node = "", body
    for part in loc:
        if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            out, node = out + f"[{part}]", node[part]
        elif isinstance(node, dict) and isinstance(part, str) and part in node:
            out, node = (f"{out}.{part}" if out else part), node.get(part)
        else:
            continue                                   # a union-branch tag
    if missing and isinstance(loc[-1], str):           # the absent field itself
        out = f"{out}.{loc[-1]}" if out else loc[-1]
    return out


def _error(e: ValidationError, body: Any) -> ApiError:
    errors = e.errors(include_url=False)
    err = errors[0]
    kind = err["type"]
    param = param_path(err["loc"], body, kind == "missing")
    union = sum(param_path(x["loc"], body) == param for x in errors) > 1
    if kind == "missing":
        code, msg = "missing_field", "is required"
    elif kind.endswith("_type") or kind.startswith(("literal", "union")):
        code = "invalid_type" if not kind.startswith("literal") else "invalid_value"
        msg = "has the wrong type" if union else f"is invalid: {err['msg']}"
    elif kind == "value_error":
        code, msg = "invalid_value", err["msg"].removeprefix("Value error, ")
    else:
        code, msg = "invalid_value", f"is invalid: {err['msg']}"
    where = f"'{param}'" if param else "the request"
    return ApiError(400, f"{where} {msg}", param=param or None, code=code)
