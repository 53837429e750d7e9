"""Reading the internal form's answers: a `chat.completion` object or a stream of
`chat.completion.chunk`s, turned into API-neutral output blocks (thinking, text, tool calls),
a finish reason and usage. Nothing here trusts the upstream: unreadable parts are skipped.

A client API shows one output block at a time (an Anthropic content block, a Responses output
item), while a chat stream may interleave parallel tool calls. `BlockSequencer` reconciles the
two: a block streams live while nothing else is happening; once a tool call is open, anything
else that arrives (another tool call, text, thinking) is collected and emitted whole, in order
of first appearance, when the stream ends. A tool call streams live only once its name is
known (the client API needs it up front); one that never gets a name is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from prefixd.api.usage import Usage
from prefixd.api.values import integer, obj

Kind = Literal["thinking", "text", "tool"]


@dataclass
class Block:
    kind: Kind
    index: int = -1            # position in the client's output, set when it starts
    call_id: str = ""          # tool calls only
    name: str = ""
    parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)


# what a stream translator is told: ("start", block, ""), ("delta", block, text),
# ("stop", block, "")
Event = tuple[Literal["start", "delta", "stop"], Block, str]


@dataclass(frozen=True)
class ToolPiece:
    index: int
    call_id: str
    name: str
    arguments: str


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def read_delta(delta: dict) -> tuple[list[tuple[Kind, str]], list[ToolPiece]]:
    """The (kind, text) pieces and tool-call pieces of one delta (or full message)."""
    texts: list[tuple[Kind, str]] = []
    for key in ("reasoning_content", "reasoning"):
        if _str(delta.get(key)):
            texts.append(("thinking", delta[key]))
            break
    if _str(delta.get("content")):
        texts.append(("text", delta["content"]))
    tools = []
    calls = delta.get("tool_calls")
    for pos, tc in enumerate(calls if isinstance(calls, list) else []):
        if not isinstance(tc, dict):
            continue
        index = integer(tc.get("index", pos))
        if index is None:
            continue
        fn = obj(tc.get("function"))
        piece = ToolPiece(index, _str(tc.get("id")), _str(fn.get("name")),
                          _str(fn.get("arguments")))
        if piece.call_id or piece.name or piece.arguments:
            tools.append(piece)
    return texts, tools


def first_choice(obj: Any) -> dict | None:
    """Choice 0 of a chat object or chunk (n > 1 is not translated)."""
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return None


def stop_string(choice: dict) -> str | None:
    """The stop sequence that ended generation, when the upstream says (vLLM: `stop_reason`)."""
    value = choice.get("stop_reason")
    return value if isinstance(value, str) and value else None


@dataclass
class Completion:
    """A non-streamed answer, read."""
    model: str
    id: str
    created: int
    blocks: list[Block]
    finish_reason: str | None
    stop_sequence: str | None
    usage: Usage


def read_completion(chat: Any) -> Completion:
    chat = chat if isinstance(chat, dict) else {}
    seq = BlockSequencer()
    choice = first_choice(chat) or {}
    message = choice.get("message")
    if isinstance(message, dict):
        seq.feed({"choices": [{"index": 0, "delta": message,
                               "finish_reason": choice.get("finish_reason")}]})
    seq.finish()
    created = chat.get("created")
    return Completion(_str(chat.get("model")), _str(chat.get("id")),
                      created if isinstance(created, int) else 0, seq.blocks,
                      seq.finish_reason, stop_string(choice), Usage.parse(chat.get("usage"))
                      or Usage())


class BlockSequencer:
    """Chat chunks -> block events, one open block at a time (see the module docstring)."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []          # started blocks, in client order
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: Usage | None = None
        self.model: str = ""
        self._open: Block | None = None
        self._tools: dict[int, Block] = {}     # every tool call seen, by upstream index
        self._held: list[Block] = []           # blocks waiting for the open tool call to end

    def feed(self, chunk: Any) -> list[Event]:
        if not isinstance(chunk, dict):
            return []
        self.model = self.model or _str(chunk.get("model"))
        self.usage = Usage.parse(chunk.get("usage")) or self.usage
        choice = first_choice(chunk)
        if choice is None:
            return []
        if isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]
            self.stop_sequence = stop_string(choice)
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return []
        texts, tools = read_delta(delta)
        events: list[Event] = []
        for kind, text in texts:
            events += self._text(kind, text)
        for piece in tools:
            events += self._tool(piece)
        return events

    def finish(self) -> list[Event]:
        """Close the open block and emit the held ones whole (a tool call that never got a
        name cannot be called: it is dropped)."""
        events = self._close()
        held, self._held = self._held, []
        for block in held:
            if block.kind == "tool" and not block.name:
                continue
            events += self._start(block, block.text)
            events += self._close()
        return events

    def _text(self, kind: Kind, text: str) -> list[Event]:
        open_ = self._open
        if open_ is not None and open_.kind == kind:
            open_.parts.append(text)
            return [("delta", open_, text)]
        if open_ is not None and open_.kind == "tool":
            if self._held and self._held[-1].kind == kind:
                self._held[-1].parts.append(text)
            else:
                self._held.append(Block(kind, parts=[text]))
            return []
        return self._close() + self._start(Block(kind), text)

    def _tool(self, piece: ToolPiece) -> list[Event]:
        block = self._tools.get(piece.index)
        if block is None:
            block = self._tools[piece.index] = Block("tool", call_id=piece.call_id,
                                                     name=piece.name)
            self._held.append(block)
        else:
            block.call_id = block.call_id or piece.call_id
            block.name = block.name or piece.name
        if piece.arguments:
            block.parts.append(piece.arguments)
        if block is self._open:
            return [("delta", block, piece.arguments)] if piece.arguments else []
        can_go_live = (block.name and block is self._held[0]
                       and (self._open is None or self._open.kind != "tool"))
        if not can_go_live:
            return []
        self._held.pop(0)
        return self._close() + self._start(block, block.text)

    def _start(self, block: Block, text: str) -> list[Event]:
        block.index = len(self.blocks)
        self.blocks.append(block)
        self._open = block
        if block.kind != "tool" and not block.parts:
            block.parts.append(text)
        start: Event = ("start", block, "")
        return [start, ("delta", block, text)] if text else [start]

    def _close(self) -> list[Event]:
        block, self._open = self._open, None
        return [("stop", block, "")] if block is not None else []
