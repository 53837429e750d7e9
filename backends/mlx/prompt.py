"""Prompt building for the mlx worker: the chat template, tokenizing, message boundaries.

Owns: rendering a `GenRequest` through the model's chat template (with the text fallback of
`tooltext` when the template ignores tools), the prompt token ids, and the message boundaries
(token positions where each message ends and where its content starts) that the engine uses as
checkpoint positions. Pure functions over a tokenizer; no mlx, no I/O. Rendering message
prefixes is bounded (`MAX_BOUNDARY_MESSAGES`) and stops early when `should_stop()` says the
client has left.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixd.api.errors import ApiError
from prefixd.backends.mlx import tooltext
from prefixd.backends.mlx.chat import GenRequest, bad
from prefixd.backends.mlx.oai import ToolFormat
from prefixd.backends.mlx.placement import common_prefix

# Rendering every message prefix costs O(messages x prompt). Past this many messages only the
# system prompt end and the newest boundaries are computed: older ones were placed (as
# checkpoints) by earlier turns of the same conversation already.
MAX_BOUNDARY_MESSAGES = 12
# ... and the prefix renders together render at most this many times the request's messages
# (or BOUNDARY_RENDER_FLOOR messages, whichever is more), newest first: a conversation of
# thousands of tiny messages costs a few renders of itself, not dozens.
BOUNDARY_RENDER_FACTOR = 4
BOUNDARY_RENDER_FLOOR = 256

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    boundaries: list[int]
    timings: dict[str, float] = field(default_factory=dict)  # template/tokenize/boundaries, s


def encode(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def never() -> bool:
    return False


class Renderer:
    """One tokenizer's chat template, and whether it renders tools itself (probed once)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "has_chat_template", True))
        self.native_tools = not self.has_template or tooltext.renders_tools(self._probe)

    def _probe(self, messages: Messages, tools: Tools) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=True)

    def tool_format(self) -> ToolFormat:
        """How the model writes tool calls: its own format, or the fallback's `<tool_call>`."""
        return ToolFormat.of(self.tokenizer) if self.native_tools else ToolFormat()

    def template_input(self, req: GenRequest) -> tuple[Messages, Tools]:
        """The messages and tools the template gets (tools written out as text if it ignores
        them)."""
        if self.native_tools or not tooltext.needs_fallback(req.messages, req.tools):
            return req.messages, req.tools
        return tooltext.as_text(req.messages, req.tools), None

    def render(self, req: GenRequest, messages: Messages, tools: Tools,
               add_generation_prompt: bool = True) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt, **req.template_kwargs)
        except Exception as e:  # jinja raise_exception(), bad kwargs: the client's input
            raise bad(f"the chat template rejected the messages: {e}", "messages") from e

    def build(self, req: GenRequest, *, boundaries: bool = True,
              should_stop: Callable[[], bool] = never) -> Prompt:
        """The prompt token ids and (for chat, if asked) the message boundaries."""
        tok, t0 = self.tokenizer, time.perf_counter()
        if req.kind == "completion":
            assert req.prompt is not None
            if isinstance(req.prompt, list):
                return Prompt(list(req.prompt), [])
            tokens = encode(tok, req.prompt, add_special_tokens=True)
            return Prompt(tokens, [], {"tokenize": time.perf_counter() - t0})
        if not self.has_template:
            raise bad("this model has no chat template; use /v1/completions", "messages")
        messages, tools = self.template_input(req)
        text = self.render(req, messages, tools)
        t1 = time.perf_counter()
        tokens = encode(tok, text)
        t2 = time.perf_counter()
        timings = {"template": t1 - t0, "tokenize": t2 - t1}
        if not boundaries:
            return Prompt(tokens, [], timings)
        found = self.boundaries(req, messages, tools, text, tokens, should_stop)
        return Prompt(tokens, found, {**timings, "boundaries": time.perf_counter() - t2})

    def boundaries(self, req: GenRequest, messages: Messages, tools: Tools, text: str,
                   tokens: list[int], should_stop: Callable[[], bool] = never) -> list[int]:
        """Token positions in `tokens` where messages end and where their content starts, by
        rendering message prefixes.

        The content start (after the role header, e.g. `<|im_start|>user\\n`) is where a new
        conversation with a known system prompt, or the next turn, first differs. A prefix
        render is usually a string prefix of the full render; when the template renders it
        differently (e.g. reasoning kept only after the last user turn) the position where the
        two texts diverge is used instead, snapped down to a token boundary. Templates that
        refuse a prefix (e.g. "conversation must start with a user turn") just give no boundary
        there. Only the first and the newest messages are rendered (older ones are already
        cached), within a budget of rendered messages (`BOUNDARY_RENDER_FACTOR`). Stops (with
        what it found) as soon as `should_stop()`.
        """
        budget = max(BOUNDARY_RENDER_FACTOR * len(messages), BOUNDARY_RENDER_FLOOR)
        token_ends = _token_ends(self.tokenizer, text, tokens)
        found: set[int] = set()
        for k in _prefix_lengths(len(messages)):
            for prefix_messages in _variants(messages, k):
                budget -= len(prefix_messages)
                if budget < 0 or should_stop():
                    return sorted(found)
                try:
                    prefix = self.render(req, prefix_messages, tools, add_generation_prompt=False)
                except ApiError:
                    continue
                chars = common_prefix(prefix, text)
                if token_ends is not None:
                    pos = bisect.bisect_right(token_ends, chars)
                else:
                    pos = common_prefix(encode(self.tokenizer, prefix[:chars]), tokens)
                if 0 < pos < len(tokens):
                    found.add(pos)
        return sorted(found)


def _prefix_lengths(n: int) -> list[int]:
    """The message prefixes to render, most useful first: the newest message's start, the
    first message's end (a system prompt shared by new conversations), then older ones."""
    ks = list(range(n - 1, 0, -1))
    if len(ks) > MAX_BOUNDARY_MESSAGES:
        ks = ks[:MAX_BOUNDARY_MESSAGES - 1] + ks[-1:]
    return ks[:1] + ks[-1:] + ks[1:-1] if len(ks) > 1 else ks


def _variants(messages: Messages, k: int) -> list[Messages]:
    """The renders that find message k-1's end and message k's content start."""
    out = [messages[:k]]
    nxt = messages[k]
    if isinstance(nxt.get("content"), str) and nxt["content"]:
        out.append([*messages[:k], {**nxt, "content": ""}])
    return out


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
