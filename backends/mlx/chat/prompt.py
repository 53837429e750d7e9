"""Prompt building for the mlx worker: the chat template, tokenizing, message boundaries.

Owns: rendering a `GenRequest` through the model's chat template (with the text fallback of
`tooltext` when the template ignores tools), the prompt token ids, and the message boundaries
(token positions where each message's content starts, and where the last one's ends) that the
engine uses as checkpoint positions. One render and one tokenization per prompt (of its new part
only, where it extends a recent prompt: `chat/suffix.py`): boundaries are found in the rendered text
with the tokenizer's offsets. Pure functions over a tokenizer; no
mlx, no I/O.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from prefixd.backends.mlx.cache.placement import common_prefix
from prefixd.backends.mlx.chat import tooltext
from prefixd.backends.mlx.chat.oai import ToolFormat
from prefixd.backends.mlx.chat.request import GenRequest, bad
from prefixd.backends.mlx.chat.suffix import SuffixEncoder, added_token_ids

# Without token offsets each boundary costs an encode of the prompt before it: then only the
# first message and the newest ones are placed (older ones were placed, as checkpoints, by
# earlier turns of the same conversation).
MAX_BOUNDARY_MESSAGES = 12

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    boundaries: list[int]
    timings: dict[str, float] = field(default_factory=dict)  # template/tokenize/boundaries, s
    thinking: bool = False  # it leaves a think block open: the reply starts in reasoning


# The generation prompt a template appends (`<|im_start|>assistant\n<think>\n`) lies within
# the prompt's last tokens; looking no further keeps a `<think>` quoted in a message out of it.
GENERATION_TAIL = 16


def opens_think(tokenizer: Any, tokens: list[int]) -> bool:
    """Whether the prompt leaves a think block open (decided once per prompt: the reply's text
    split and a constraint's grammar both follow it)."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    tail = tokens[-GENERATION_TAIL:]
    return bool(tokenizer.rfind_think_start(tail) > tokenizer.rfind_think_end(tail))


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
        self._backend_ids = backend_ids_match(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.suffix = (SuffixEncoder(backend, added_token_ids(tokenizer))
                       if backend is not None and self._backend_ids else None)

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
        """The prompt token ids, (for chat, if asked) the message boundaries, and whether it
        leaves a think block open."""
        prompt = self._build(req, boundaries, should_stop)
        return replace(prompt, thinking=opens_think(self.tokenizer, prompt.tokens))

    def _build(self, req: GenRequest, boundaries: bool,
               should_stop: Callable[[], bool]) -> Prompt:
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
        if not boundaries:
            tokens = encode(tok, text)
            return Prompt(tokens, [], {"template": t1 - t0, "tokenize": time.perf_counter() - t1})
        tokens, ends = self._encode(text)
        t2 = time.perf_counter()
        found = self.boundaries(messages, text, tokens, ends, should_stop)
        return Prompt(tokens, found, {"template": t1 - t0, "tokenize": t2 - t1,
                                      "boundaries": time.perf_counter() - t2})

    def _encode(self, text: str) -> tuple[list[int], list[int] | None]:
        """The ids of `text`, and the end character offset of each token when the fast
        tokenizer gives offsets that match the ids (else None)."""
        if self.suffix is not None:  # the new part only, where it extends a recent prompt
            return self.suffix.encode(text)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        tokens = encode(self.tokenizer, text)
        if backend is None:
            return tokens, None
        try:
            enc = backend.encode(text, add_special_tokens=False)
        except Exception:
            return tokens, None
        return tokens, _ends(enc) if list(enc.ids) == tokens else None

    def boundaries(self, messages: Messages, text: str, tokens: list[int],
                   ends: list[int] | None, should_stop: Callable[[], bool] = never
                   ) -> list[int]:
        """Token positions in `tokens` where each message's content starts (after its role
        header, e.g. `<|im_start|>user\n`: where a new conversation with a known system
        prompt, an edited message or the next turn first differs) and where the last message's
        content ends (the generation prompt starts there), snapped down to token boundaries.

        Found in the rendered prompt itself, no extra renders: each message's content is
        searched in order after the previous one's; one the template rewrote (not found
        verbatim) gives no boundary. Without token offsets (`ends`), each position costs an
        encode of the text before it, so only the first message and the newest are placed,
        stopping as soon as `should_stop()`.
        """
        chars = content_positions(messages, text)
        if ends is not None:
            found = {bisect.bisect_right(ends, c) for c in chars}
        else:
            found = set()
            picked = chars[:1] + chars[1:][-MAX_BOUNDARY_MESSAGES:]
            for c in reversed(picked):
                if should_stop():
                    break
                found.add(common_prefix(encode(self.tokenizer, text[:c]), tokens))
        return sorted(p for p in found if 0 < p < len(tokens))


def content_positions(messages: Messages, text: str) -> list[int]:
    """Character offsets in `text` where each message's content starts, in order, and where
    the last message's content ends (if the last message was found)."""
    out, cursor, last_end = [], 0, None
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, str) or not content.strip():
            continue
        at = text.find(content, cursor)
        if at < 0:  # templates that trim content
            content = content.strip()
            at = text.find(content, cursor)
        if at < 0:
            continue
        cursor = at + len(content)
        out.append(at)
        last_end = cursor if i == len(messages) - 1 else None
    return out + ([last_end] if last_end is not None else [])


def _ends(enc: Any) -> list[int] | None:
    ends = [end for _, end in enc.offsets]
    return ends if ends == sorted(ends) else None


def backend_ids_match(tokenizer: Any) -> bool:
    """Whether the fast tokenizer's own encode gives the same ids as the tokenizer's encode
    (then one encode gives both the ids and their offsets)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    specials = [t for t in (getattr(tokenizer, "eos_token", None),
                            getattr(tokenizer, "bos_token", None)) if isinstance(t, str)]
    probe = " ".join(["Hello  world,\n\n\tthe river's 12,345 é 日本語 🙂", *specials, "end\n"])
    try:
        return list(backend.encode(probe, add_special_tokens=False).ids) == encode(tokenizer,
                                                                                   probe)
    except Exception:
        return False
