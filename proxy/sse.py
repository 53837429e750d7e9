"""Read what an upstream answered, without slowing the relay: split SSE into events, note
the first content event (time to first token), assemble the assistant message and `usage`.

`SSERecorder.feed()` returns the bytes to pass on: complete events only (a partial event is
held until its end arrives), minus the usage that prefixd asked for on the client's behalf.
With a translator, the events are handed to it and its output is passed on instead.
Upstream data is untrusted: any shape (wrong types, `\\r\\n` framing, huge or deeply nested
events) is either relayed as it came or skipped, never raised on.
"""

from __future__ import annotations

import json
import time
from typing import Any

from prefixd.api.usage import Usage
from prefixd.api.values import count, obj

Message = dict[str, Any]
# finish reasons that say the server stopped the answer (vLLM's `abort`, ...), not that it ended
STOPPED = frozenset({"abort", "aborted", "cancelled", "canceled", "error", "interrupted"})
MAX_EVENT_BYTES = 16 * 1024 * 1024


class UpstreamProtocolError(Exception):
    """The upstream's stream cannot be relayed (an event larger than MAX_EVENT_BYTES)."""


def _index(value: Any, default: int) -> int:
    index = count(value, limit=1024)
    return default if index is None else index


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


class MessageBuilder:
    """Assemble an assistant message from chat deltas, or take it from a full choice."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}

    def add_delta(self, delta: Any) -> bool:
        """Add one delta; True if it carried generated content."""
        if not isinstance(delta, dict):
            return False
        got = False
        for key, parts in (("content", self.content), ("reasoning_content", self.reasoning),
                           ("reasoning", self.reasoning), ("text", self.content)):
            v = delta.get(key)
            if isinstance(v, str) and v:
                parts.append(v)
                got = True
        calls = delta.get("tool_calls")
        for tc in calls if isinstance(calls, list) else ():
            if not isinstance(tc, dict):
                continue
            got = True
            slot = self.tool_calls.setdefault(
                _index(tc.get("index"), len(self.tool_calls)),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            if isinstance(tc.get("id"), str):
                slot["id"] = tc["id"]
            fn = obj(tc.get("function"))
            slot["function"]["name"] += _text(fn.get("name"))
            args = fn.get("arguments")
            slot["function"]["arguments"] += (args if isinstance(args, str) else
                                              json.dumps(args) if isinstance(args, dict) else "")
        return got

    def message(self) -> Message:
        msg: Message = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            msg["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return msg


def loads(data: bytes) -> Any:
    """json.loads that returns None for anything that is not JSON (or is nested too deep)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def parse_json_body(data: bytes) -> tuple[Message | None, Usage | None]:
    """(assistant message, usage) of a non-streamed chat or completions answer; a prefixd
    worker's breakdown rides along as `Usage.worker`."""
    obj = loads(data)
    if not isinstance(obj, dict):
        return None, None
    usage = Usage.parse(obj.get("usage"), obj.get("prefixd"))
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None, usage
    choice = choices[0]
    b = MessageBuilder()
    b.add_delta(choice["message"] if isinstance(choice.get("message"), dict) else choice)
    return b.message(), usage


class SSERecorder:
    def __init__(self, strip_usage: bool, translate: Any = None) -> None:
        self.strip_usage = strip_usage   # prefixd added include_usage; the client did not ask
        self.translate = translate       # a translator's stream state, or None (pass through)
        self.usage: Usage | None = None
        self.first_content_at: float | None = None
        self.done = False                # the upstream's `data: [DONE]` went through
        self.finished = False            # a choice carried its finish_reason
        self.error: dict[str, Any] | None = None   # an in-band error event (held, not passed)
        self.events = 0
        # comment-only events (a prefixd worker's `: queued position=N`), taken out of the
        # answer's bytes: the relay sends them on at once, even while it holds the answer back
        self.notes: list[bytes] = []
        self.builder = MessageBuilder()
        self._buf = bytearray()
        self._scanned = 0                # bytes of _buf already searched for an event end
        self._cr = False

    def feed(self, chunk: bytes) -> bytes:
        if self._cr and chunk.startswith(b"\n"):   # the LF of a CRLF split across chunks
            chunk = chunk[1:]
        self._cr = False
        if b"\r" in chunk:              # SSE allows CRLF and CR line ends: make them LF
            self._cr = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        self._buf += chunk
        end = self._buf.rfind(b"\n\n", max(0, self._scanned - 1))
        if end < 0:
            self._scanned = len(self._buf)
            if len(self._buf) > MAX_EVENT_BYTES:
                raise UpstreamProtocolError(f"an upstream SSE event is larger than "
                                            f"{MAX_EVENT_BYTES} bytes")
            return b""
        ready = bytes(self._buf[: end + 2])
        del self._buf[: end + 2]
        self._scanned = len(self._buf)
        return self._pass(ready, ready.split(b"\n\n")[:-1])

    def flush(self) -> bytes:
        """What is left when the upstream ended without a final blank line."""
        rest = bytes(self._buf)
        self._buf.clear()
        if not rest.strip():
            return b"" if self.translate is not None else rest
        return self._pass(rest + b"\n\n", [rest.rstrip(b"\n")])

    def take_notes(self) -> bytes:
        """The comment events seen since the last call."""
        notes, self.notes = b"".join(self.notes), []
        return notes

    @property
    def ended(self) -> bool:
        """The upstream ended its answer as a complete one: `[DONE]`, or a finish reason."""
        return self.done or self.finished

    def _pass(self, ready: bytes, events: list[bytes]) -> bytes:
        kept: list[bytes | None] = []
        notes = len(self.notes)
        for event in events:
            if self.error is not None:
                break                            # nothing after the upstream's error passes
            if event and all(line.startswith(b":") for line in event.split(b"\n")):
                self.notes.append(event + b"\n\n")
                continue
            kept.append(self._event(event))
        if self.translate is not None:
            return b"".join(k for k in kept if k)
        if not self.strip_usage and self.error is None and len(self.notes) == notes:
            return ready                         # nothing removed: pass the bytes as they came
        return b"".join(k + b"\n\n" for k in kept if k is not None)

    def _event(self, event: bytes) -> bytes | None:
        """The event to pass on (None: drop it); with a translator, its output bytes."""
        self.events += 1
        data = b"".join(line[5:].lstrip() for line in event.split(b"\n")
                        if line.startswith(b"data:"))
        if data == b"[DONE]":
            self.done = True
            return b"" if self.translate is not None else event
        obj = loads(data) if data else None
        if not isinstance(obj, dict):
            return b"" if self.translate is not None else event
        if "error" in obj and not obj.get("choices"):
            # The upstream says the answer stops here (it failed, or was stopped): the relay
            # reports that in the client API's own way, once, with the end of the stream.
            self.error = obj
            return None
        if isinstance(obj.get("usage"), dict):
            self.usage = Usage.parse(obj["usage"], obj.get("prefixd"))
        choices = obj.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else choice
            if self.builder.add_delta(delta) and self.first_content_at is None:
                self.first_content_at = time.monotonic()
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                if reason.lower() in STOPPED:        # the server's own word for a stop
                    self.error = {"error": {"message": f"the backend stopped the answer "
                                           f"(finish_reason {reason!r})",
                                           "type": "server_error", "code": "upstream_error"}}
                    return None
                self.finished = True
        if self.translate is not None:
            return self.translate.feed(obj)
        if self.strip_usage and "usage" in obj:
            if not choices:
                return None
            del obj["usage"]
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode()
        return event
