"""Chat completions answer -> Anthropic Messages API answer: the `message` object and the
streamed event sequence (`message_start`, `ping`, `content_block_start/delta/stop` per block,
`message_delta`, `message_stop`; `error` on a mid-stream failure).

Anthropic's `input_tokens` excludes cache reads: input_tokens = prompt - cached,
cache_read_input_tokens = cached. Thinking blocks carry an empty `signature` (a local model
signs nothing). A tool call whose arguments are not a JSON object gets `input: {}` in a
non-streamed message; a stream relays the arguments as the model wrote them.
"""

from __future__ import annotations

import json
from typing import Any

from prefixd.api.usage import Usage
from prefixd.proxy.translate.base import new_id, sse
from prefixd.proxy.translate.chat import Block, Event, read_completion
from prefixd.proxy.translate.stream import BlockStream


def usage(u: Usage | None) -> dict[str, int]:
    u = u or Usage()
    prompt, cached = u.prompt or 0, u.cached or 0
    return {"input_tokens": max(prompt - cached, 0), "output_tokens": u.completion or 0,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop_reason(finish: str | None, blocks: list[Block], stop_sequence: str | None) -> str:
    if finish == "length":
        return "max_tokens"
    if any(b.kind == "tool" for b in blocks):
        return "tool_use"
    if stop_sequence:
        return "stop_sequence"
    return "refusal" if finish == "content_filter" else "end_turn"


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _block(block: Block, full: bool) -> dict[str, Any]:
    """A content block: complete (`full`) or as `content_block_start` announces it."""
    if block.kind == "thinking":
        return {"type": "thinking", "thinking": block.text if full else "", "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text if full else ""}
    block.call_id = block.call_id or new_id("toolu")
    return {"type": "tool_use", "id": block.call_id, "name": block.name,
            "input": _input(block.text) if full else {}}


def message(chat: dict) -> dict:
    """A non-streamed chat.completion -> an Anthropic `message`."""
    done = read_completion(chat)
    reason = stop_reason(done.finish_reason, done.blocks, done.stop_sequence)
    msg_id = f"msg_{done.id.removeprefix('chatcmpl-')}" if done.id else new_id("msg")
    return {"id": msg_id, "type": "message", "role": "assistant", "model": done.model,
            "content": [_block(b, full=True) for b in done.blocks],
            "stop_reason": reason,
            "stop_sequence": done.stop_sequence if reason == "stop_sequence" else None,
            "usage": usage(done.usage)}


_DELTA = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
          "tool": ("input_json_delta", "partial_json")}


class AnthropicStream(BlockStream):
    def __init__(self) -> None:
        super().__init__()
        self._id = new_id("msg")

    def _close(self) -> bytes:
        seq = self._seq
        reason = stop_reason(seq.finish_reason, seq.blocks, seq.stop_sequence)
        delta = {"stop_reason": reason,
                 "stop_sequence": seq.stop_sequence if reason == "stop_sequence" else None}
        return (sse("message_delta", {"type": "message_delta", "delta": delta,
                                      "usage": usage(seq.usage)})
                + sse("message_stop", {"type": "message_stop"}))

    def _fail(self, body: dict) -> bytes:
        return sse("error", body)

    def _begin(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        start: dict[str, Any] = {
            "id": self._id, "type": "message", "role": "assistant", "model": self._seq.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage(Usage(prompt=self.prompt_tokens))}
        return (sse("message_start", {"type": "message_start", "message": start})
                + sse("ping", {"type": "ping"}))

    def _render(self, events: list[Event]) -> bytes:
        out = []
        for what, block, text in events:
            if what == "start":
                out.append(sse("content_block_start", {
                    "type": "content_block_start", "index": block.index,
                    "content_block": _block(block, full=False)}))
            elif what == "delta":
                kind, key = _DELTA[block.kind]
                out.append(sse("content_block_delta", {
                    "type": "content_block_delta", "index": block.index,
                    "delta": {"type": kind, key: text}}))
            else:
                out.append(sse("content_block_stop", {"type": "content_block_stop",
                                                      "index": block.index}))
        return b"".join(out)
