"""OpenAI response shapes for the mlx worker: objects, stream chunks, SSE framing, usage, and
the reasoning and tool calls found in generated text.

Owns: the exact JSON the worker sends (`chat.completion`, `chat.completion.chunk`,
`text_completion`) and how a chat reply's text splits into reasoning, content and tool calls
while it streams (a tool call's marker held back, as a stop string is: `stops.py`). Pure; no
mlx, no aiohttp.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from prefixd.backends.mlx.chat.stops import StopMatcher

DONE = b"data: [DONE]\n\n"
Kind = Literal["chat", "completion"]


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class Shapes:
    """Builds every object of one response, sharing its id, creation time and model name."""

    kind: Kind
    model: str

    def __post_init__(self) -> None:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        self.id = prefix + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completion" else (
            "chat.completion.chunk" if chunk else "chat.completion")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def final(self, text: str, finish_reason: str, usage_: dict[str, Any],
              tool_calls: list[dict[str, Any]] | None = None,
              reasoning: str | None = None,
              logprobs: dict[str, Any] | None = None,
              stop_reason: str | None = None) -> dict[str, Any]:
        """The whole non-streamed response. `stop_reason`: the stop string that ended it (as
        vLLM names it; the proxy's Messages API reports it as `stop_sequence`)."""
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs,
                                      "finish_reason": finish_reason}
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning:
                message["reasoning_content"] = reasoning
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": 0, "message": message, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        if stop_reason is not None:
            choice["stop_reason"] = stop_reason
        return {**self._envelope(False), "choices": [choice], "usage": usage_}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, *,
              role: bool = False, tool_calls: list[dict[str, Any]] | None = None,
              reasoning: str | None = None,
              logprobs: dict[str, Any] | None = None,
              stop_reason: str | None = None) -> dict[str, Any]:
        """One stream chunk: a text delta, the opening role delta, or the closing finish_reason
        (and `stop_reason`, as in `final`)."""
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": logprobs,
                                      "finish_reason": finish_reason}
        else:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
                delta["content"] = ""
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(tool_calls)]
            choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        if stop_reason is not None:
            choice["stop_reason"] = stop_reason
        return {**self._envelope(True), "choices": [choice]}

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        """The extra last chunk of `stream_options.include_usage`: empty choices, usage set."""
        return {**self._envelope(True), "choices": [], "usage": usage_}


def _json_call(text: str, tools: Any = None) -> Any:
    return json.loads(text.strip())


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes tool calls: the markers around a call and the parser of the text
    between them (mlx-lm's per-model `tool_parsers`); default: Qwen/Hermes `<tool_call>` JSON."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"
    parse: Callable[[str, Any], Any] = _json_call

    @property
    def json_body(self) -> bool:
        """Whether a call is the JSON `{"name": ..., "arguments": ...}` between the markers
        (the default's and mlx-lm's `json_tools`), the form structured output can enforce."""
        return self.parse is _json_call or getattr(self.parse, "__module__", "").endswith(
            ".json_tools")

    @classmethod
    def of(cls, tokenizer: Any) -> ToolFormat:
        if getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_parser is not None:
            return cls(tokenizer.tool_call_start, tokenizer.tool_call_end or "",
                       tokenizer.tool_parser)
        return cls()


def _openai_call(call: Any) -> dict[str, Any] | None:
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return None
    args = call.get("arguments", {})
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call["name"], "arguments": args if isinstance(args, str)
                         else json.dumps(args, ensure_ascii=False)}}


def extract_tool_calls(text: str, fmt: ToolFormat = ToolFormat(), tools: Any = None,
                       ) -> tuple[str, list[dict[str, Any]]]:
    """Split the tool calls out of generated text, as OpenAI `tool_calls`. A block that does
    not parse (e.g. cut by max_tokens) stays in the text; a call that repeats an earlier one
    exactly (same name and arguments: a model looping, `grammar/matcher.py`'s `CallRepeats`) is
    dropped."""
    calls: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()
    tail = re.escape(fmt.end) if fmt.end else r"\Z"  # no end marker: the call runs to the end
    pattern = re.compile(re.escape(fmt.start) + r"(.*?)" + tail, re.DOTALL)

    def take(match: re.Match[str]) -> str:
        try:
            parsed = fmt.parse(match.group(1), tools)
        except Exception:  # model output: any parser error means "not a call"
            return match.group(0)
        found = [_openai_call(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        if not found or None in found:
            return match.group(0)
        for c in found:
            assert c is not None
            key = (c["function"]["name"], c["function"]["arguments"])
            if key not in seen:
                seen.add(key)
                calls.append(c)
        return ""

    rest = pattern.sub(take, text)
    return (rest.strip() if calls else rest), calls


class _Reasoning:
    """Routes the text before the end-of-thinking marker to reasoning, the rest to content.
    A reply is reasoning from the start if the prompt left a thinking block open, or if it
    opens one itself (only whitespace before the start marker)."""

    def __init__(self, start: str, end: str, thinking: bool) -> None:
        self.start = start
        self.state = "reasoning" if thinking else "lead"
        self._lead = ""
        self._end = StopMatcher([end])
        self._end_len = len(end)

    def feed(self, text: str) -> tuple[str, str]:
        if self.state == "lead":
            self._lead += text
            stripped = self._lead.lstrip()
            if not stripped or (self.start.startswith(stripped) and stripped != self.start):
                return "", ""  # still undecided
            if stripped.startswith(self.start):
                self.state, self._lead = "reasoning", ""
                text = stripped[len(self.start):]
            else:
                self.state, text, self._lead = "content", self._lead, ""
                return "", text
        reasoning = ""
        if self.state == "reasoning":
            reasoning = self._end.feed(text)
            if not self._end.hit:
                return reasoning, ""
            self.state, text = "after", self._end.held[self._end_len:]
        if self.state == "after":  # the blank lines between the think block and the answer
            text = text.lstrip()
            if text:
                self.state = "content"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        if self.state == "lead":
            return "", self._lead
        return (self._end.flush(), "") if self.state == "reasoning" else ("", "")


class ChatOutput:
    """Shapes a chat reply while it streams: reasoning, content, and tool calls (text from a
    tool-call start marker on is held back until the end, then parsed)."""

    def __init__(self, tools: ToolFormat | None = None, tool_specs: Any = None,
                 think: tuple[str, str] | None = None, thinking: bool = False) -> None:
        self._tools, self._specs = tools, tool_specs
        self._gate = StopMatcher([tools.start] if tools else [])
        self._reasoning = _Reasoning(*think, thinking) if think else None

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that can be sent now."""
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return reasoning, self._gate.feed(content) if content else ""

    def finish(self, cut: bool = False) -> tuple[str, str, list[dict[str, Any]]]:
        """The rest: (reasoning, content, tool_calls). `cut`: the reply ran out of tokens, so
        a call still open is a cut call, not text: it is dropped (the calls before it stay)."""
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        if content:
            content = self._gate.feed(content)
        held = self._gate.held + self._gate.flush()
        calls: list[dict[str, Any]] = []
        if held and self._tools is not None:
            held, calls = extract_tool_calls(held, self._tools, self._specs)
            if cut and self._tools.start in held:
                held = held[:held.index(self._tools.start)].rstrip()
        return reasoning, content + held, calls
