"""Upstream chat answers shared by the translate tests: streamed chunk scenarios (what llama.cpp,
vLLM and prefixd's worker send) and their non-streamed equivalents."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures" / "clients"


def client_request(name: str) -> dict[str, Any]:
    """A captured client request: {method, path, query, headers, body}."""
    return json.loads((FIXTURES / name).read_text())


def chunk(delta: Any = None, finish: str | None = None, **choice: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "model": "qwen3",
            "choices": [{"index": 0, "delta": {} if delta is None else delta,
                         "finish_reason": finish, **choice}]}


def usage(prompt: int = 100, completion: int = 9, cached: int = 0) -> dict[str, Any]:
    return {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "model": "qwen3",
            "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion,
                                     "prompt_tokens_details": {"cached_tokens": cached}}}


def call(index: int, arguments: str = "", id_: str | None = None,
         name: str | None = None) -> dict[str, Any]:
    """A delta holding one tool-call piece (id and name on the first piece only)."""
    piece: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if id_ is not None:
        piece.update(id=id_, type="function")
        piece["function"]["name"] = name
    return {"tool_calls": [piece]}


def split(text: str, size: int = 4) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def interleave(a: list[Any], b: list[Any]) -> list[Any]:
    return [x for pair in itertools.zip_longest(a, b) for x in pair if x is not None]


ARGS_A = '{"command": "ls -la", "description": "list files"}'
ARGS_B = '{"file_path": "/tmp/x.txt"}'

STREAMS: dict[str, list[Any]] = {
    "text": [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}),
             chunk({"content": "lo"}), chunk(finish="stop"), usage(120, 2, cached=96)],
    "tool_split": [chunk({"role": "assistant"}), chunk(call(0, "", "call_1", "Bash")),
                   *[chunk(call(0, part)) for part in split(ARGS_A)],
                   chunk(finish="tool_calls"), usage()],
    "parallel_interleaved": [chunk(call(0, "", "call_a", "Bash")),
                             chunk(call(1, "", "call_b", "Read")),
                             *interleave([chunk(call(0, p)) for p in split(ARGS_A, 8)],
                                         [chunk(call(1, p)) for p in split(ARGS_B, 8)]),
                             chunk(finish="tool_calls"), usage()],
    "reasoning_text_tool": [chunk({"role": "assistant", "reasoning_content": "Let me "}),
                            chunk({"reasoning_content": "look."}), chunk({"content": "Listing."}),
                            chunk(call(0, "", "call_1", "Bash")), chunk(call(0, ARGS_A)),
                            chunk(finish="tool_calls"), usage(50, 20, cached=10)],
    "reasoning_key": [chunk({"reasoning": "hm"}), chunk({"content": "ok"}), chunk(finish="stop"),
                      usage()],
    "malformed": ["not a dict", {"choices": "nope"}, {"choices": [7]},
                  chunk("delta is a string"), chunk({"content": 5}),
                  chunk({"tool_calls": "x"}), chunk({"tool_calls": [{"index": "0"}]}),
                  chunk({"tool_calls": [{"index": 0, "function": "Bash"}]}),
                  chunk({"content": "fine"}), {"choices": [], "usage": "lots"},
                  chunk(finish="stop"), usage(10, 1)],
    "length": [chunk({"content": "abc"}), chunk(finish="length"), usage(5, 3)],
    "empty": [],
}


def completion(message: dict[str, Any], finish: str = "stop", prompt: int = 100,
               completion_tokens: int = 9, cached: int = 0, **choice: Any) -> dict[str, Any]:
    """A non-streamed chat.completion."""
    return {"id": "chatcmpl-abc", "object": "chat.completion", "created": 1700000000,
            "model": "qwen3",
            "choices": [{"index": 0, "message": {"role": "assistant", **message},
                         "finish_reason": finish, **choice}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                      "total_tokens": prompt + completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": cached}}}


def tool_call(id_: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}
