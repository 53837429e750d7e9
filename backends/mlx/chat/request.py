"""Request parsing for the mlx worker: the shared schema's typed request (`prefixd.api.schema`,
the same limits and 400s as the proxy) turned into a `GenRequest` for generation.

Owns: sampling options, the messages and tools in the shape HF chat templates expect, and the
worker's own capability checks, each a 400 naming the parameter: `n` > 1, non-text content
parts, a `response_format` or tool schema it cannot enforce (`api/structured.py`), `echo`, `suffix`,
`logprobs` in the wrong form. Every client mistake becomes an `ApiError(400)` here or in the
schema, never deeper. Pure; no mlx, no I/O.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from prefixd.api.errors import ApiError
from prefixd.api.schema import (
    ChatRequest,
    CompletionRequest,
    Kind,
    Message,
    Parsed,
    Request,
    validate,
)
from prefixd.api.structured import Constraint, check, constraint

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Sampling:
    """Decoding options. `temperature` 0 means greedy; defaults follow the OpenAI API."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None  # None (or negative in the request): not reseeded
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    constraint: Constraint | None = None  # structured output (grammar.py); None: free



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
    logprobs: int | None = None  # None: no log-probs; else how many alternatives per token


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


def parse_request(kind: Kind, body: dict[str, Any]) -> GenRequest:
    """Validate a decoded body with the shared schema, then as `gen_request`."""
    return gen_request(Parsed(kind, b"", body, validate(kind, body)))


def gen_request(parsed: Parsed) -> GenRequest:
    """The worker's view of a request the schema accepted; ApiError(400) for what the worker
    cannot do."""
    req, body = parsed.req, parsed.body
    _check_capabilities(req)
    sampling = _sampling(req)
    tools = _tools(req, body) if isinstance(req, ChatRequest) else None
    if isinstance(req, ChatRequest):
        c = constraint(req.response_format, tools, req.tool_choice, req.parallel_tool_calls)
    else:
        c = constraint(req.response_format, None, None, None)
    check(c)  # the proxy checked it too; a client of the worker itself gets the same 400s
    sampling = replace(sampling, constraint=c)
    out = GenRequest(kind=parsed.kind, model=req.model, sampling=sampling,
                     stream=bool(req.stream), include_usage=req.wants_usage,
                     logprobs=_logprobs(req))
    if isinstance(req, CompletionRequest):
        out.prompt = req.text_or_ids
        return out
    assert isinstance(req, ChatRequest)
    out.messages = [_message(i, m, raw) for i, (m, raw)
                    in enumerate(zip(req.messages, body["messages"], strict=True))]
    out.tools = tools
    out.template_kwargs = req.chat_template_kwargs or {}
    return out


def _check_capabilities(req: Request) -> None:
    if req.n not in (None, 1):
        raise bad("only n=1 is supported", "n")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise bad("'echo' is not supported by this worker", "echo")
        if req.suffix:
            raise bad("'suffix' (fill-in-the-middle) is not supported by this worker", "suffix")


def _logprobs(req: Request) -> int | None:
    """How many alternatives to report per generated token (0: only the chosen one's), or None
    for no log-probabilities. Chat: `logprobs: true` + `top_logprobs`; completions: an integer
    `logprobs`."""
    lp = req.logprobs
    if isinstance(req, CompletionRequest):
        if lp is None:
            return None
        if type(lp) is not int or not 0 <= lp <= MAX_TOP_LOGPROBS:
            raise bad(f"'logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS} for "
                      "completions", "logprobs")
        return lp
    if lp is not None and type(lp) is not bool:
        raise bad("'logprobs' must be a boolean for chat completions (the number of "
                  "alternatives is 'top_logprobs')", "logprobs")
    if not lp:
        if req.top_logprobs:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return req.top_logprobs or 0


def _sampling(req: Request) -> Sampling:
    bias = None
    if req.logit_bias:
        try:
            bias = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError:
            raise bad("'logit_bias' keys must be token ids", "logit_bias") from None
        if min(bias) < 0:
            raise bad("'logit_bias' keys must be token ids", "logit_bias")
    return Sampling(
        max_tokens=req.limit,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),  # -1 and 0: no top-k
        min_p=req.min_p or 0.0,
        stop=req.stops,
        # A negative seed asks for no fixed seed, as llama.cpp's -1 does.
        seed=req.seed if req.seed is not None and req.seed >= 0 else None,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=bias,
    )


def check_vocab(req: GenRequest, vocab_size: int) -> None:
    """400 for token ids the model does not have (a prompt of ids, logit_bias keys)."""
    if isinstance(req.prompt, list) and max(req.prompt) >= vocab_size:
        raise bad("'prompt' holds a token id outside the vocabulary", "prompt")
    bias = req.sampling.logit_bias
    if bias and max(bias) >= vocab_size:
        raise bad(f"'logit_bias' names a token id outside the vocabulary ({vocab_size} ids)",
                  "logit_bias")


def _message(i: int, m: Message, raw: dict[str, Any]) -> dict[str, Any]:
    """A copy of one message in the shape HF chat templates expect."""
    text = m.text()
    if text is None:
        raise bad(f"'messages[{i}].content': only text content parts are supported",
                  f"messages[{i}].content")
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": text}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.role == "assistant":
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if m.tool_calls is not None:
            out["tool_calls"] = [_tool_call(c) for c in raw["tool_calls"]]
    return out


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    args = fn.get("arguments")
    if isinstance(args, str):
        # Templates render arguments with `| tojson`; a string that is not JSON (a model's
        # own truncated call, sent back by the client) stays a string rather than failing.
        with contextlib.suppress(json.JSONDecodeError):
            args = json.loads(args) if args.strip() else {}
    return {**call, "function": {**fn, "arguments": args if args is not None else {}}}


def _tools(req: ChatRequest, body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tool definitions as the client sent them (their bytes reach the template), or None.
    `tool_choice`: none drops them; auto (or absent) lets the model choose; required or a named
    function forces a call (`structured.tool_constraint`)."""
    if req.tool_choice == "none":
        return None
    if not body.get("tools") and req.tool_choice not in (None, "auto"):
        raise bad("'tool_choice' forces a call, and 'tools' is empty", "tool_choice")
    return body.get("tools") or None
