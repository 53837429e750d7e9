"""Read what an upstream answered, without slowing the relay: split SSE into events, note
the first content event (time to first token), assemble the assistant message and `usage`.

`SSERecorder.feed()` returns the bytes to pass on: complete events only (a partial event is
held until its end arrives), minus the usage that prefixd asked for on the client's behalf.
"""

from __future__ import annotations

import json
import time
from typing import Any

Message = dict[str, Any]


class MessageBuilder:
    """Assemble an assistant message from chat deltas, or take it from a full choice."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}

    def add_delta(self, delta: dict[str, Any]) -> bool:
        """Add one delta; True if it carried generated content."""
        got = False
        for key, parts in (("content", self.content), ("reasoning_content", self.reasoning),
                           ("reasoning", self.reasoning), ("text", self.content)):
            v = delta.get(key)
            if isinstance(v, str) and v:
                parts.append(v)
                got = True
        for tc in delta.get("tool_calls") or []:
            if not isinstance(tc, dict):
                continue
            got = True
            slot = self.tool_calls.setdefault(int(tc.get("index", len(self.tool_calls))),
                                              {"id": None, "type": "function",
                                               "function": {"name": "", "arguments": ""}})
            slot["id"] = tc.get("id") or slot["id"]
            fn = tc.get("function") or {}
            slot["function"]["name"] += fn.get("name") or ""
            slot["function"]["arguments"] += fn.get("arguments") or ""
        return got

    def message(self) -> Message:
        msg: Message = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            msg["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return msg


def parse_json_body(data: bytes) -> tuple[Message | None, dict[str, Any] | None]:
    """(assistant message, usage) of a non-streamed chat or completions answer."""
    try:
        obj = json.loads(data)
    except ValueError:
        return None, None
    if not isinstance(obj, dict):
        return None, None
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else None
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None, usage
    choice = choices[0]
    b = MessageBuilder()
    if isinstance(choice.get("message"), dict):
        b.add_delta(choice["message"])
    else:
        b.add_delta(choice)
    return b.message(), usage


class SSERecorder:
    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage   # prefixd added include_usage; the client did not ask
        self.usage: dict[str, Any] | None = None
        self.first_content_at: float | None = None
        self.events = 0
        self.builder = MessageBuilder()
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        self._buf += chunk
        end = self._buf.rfind(b"\n\n")
        if end < 0:
            return b""
        ready, self._buf = self._buf[: end + 2], self._buf[end + 2:]
        kept = [self._event(event) for event in ready.split(b"\n\n")[:-1]]
        if not self.strip_usage:                 # nothing removed: pass the bytes as they came
            return ready
        return b"".join(k + b"\n\n" for k in kept if k is not None)

    def flush(self) -> bytes:
        """What is left when the upstream ended without a final blank line."""
        rest, self._buf = self._buf, b""
        if not rest.strip():
            return rest
        kept = self._event(rest.rstrip(b"\n"))
        return b"" if kept is None else kept + b"\n\n"

    def _event(self, event: bytes) -> bytes | None:
        self.events += 1
        data = b"".join(line[5:].lstrip() for line in event.split(b"\n")
                        if line.startswith(b"data:"))
        if not data or data == b"[DONE]":
            return event
        try:
            obj = json.loads(data)
        except ValueError:
            return event
        if not isinstance(obj, dict):
            return event
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else choice
            if self.builder.add_delta(delta) and self.first_content_at is None:
                self.first_content_at = time.monotonic()
        if self.strip_usage and "usage" in obj:
            if not obj.get("choices"):
                return None
            del obj["usage"]
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode()
        return event
