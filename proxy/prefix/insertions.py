"""What canonicalization writes into messages, and how it is replayed (docs/MUTATIONS.md,
Rules): restatement blocks of pinned values in the newest turn, and trailing reminders a
client dropped from an older message (`keep_trailing_reminder`).

Every insertion is recorded with the fingerprint of the message it went into, as the client
sent it, and re-applied byte for byte whenever that message comes back as history, so the
proxy's own text never becomes the next turn's mutation. Pure: messages in, edited copies
out; the lane's `Book` is only read here (canonicalize.commit writes it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixd.proxy.prefix.patterns import dropped_reminder
from prefixd.proxy.prefix.segments import canonical

OPEN, CLOSE = '\n\n<context-update source="proxy">\n', "\n</context-update>"
SUPERSEDES = " (supersedes the value in the system prompt)"
MAX_ENTRIES = 512


@dataclass(slots=True)
class Book:
    """The insertions of one view of a lane: forwarded, or the dry-run shadow."""

    blocks: dict[str, str] = field(default_factory=dict)   # fingerprint -> restatement block
    kept: dict[str, str] = field(default_factory=dict)     # fingerprint -> reminder re-appended
    said: dict[str, str] = field(default_factory=dict)     # pinned line -> value last restated

    def nbytes(self) -> int:
        return sum(len(k) + len(v) for d in (self.blocks, self.kept, self.said)
                   for k, v in d.items())

    def record(self, book: dict[str, str], key: str, value: str) -> None:
        book[key] = value
        while len(book) > MAX_ENTRIES:
            book.pop(next(iter(book)))


def fingerprint(index: int, message: Any) -> str:
    """`<index>:<hash of the message as the client sent it>`; the index lets a lookup hash
    only the messages that have a recorded insertion."""
    digest = hashlib.sha1(canonical(message).encode("utf-8", "surrogatepass")).hexdigest()
    return f"{index}:{digest[:20]}"


def replay(messages: list, book: dict[str, str],
           apply: Callable[[dict, str], dict]) -> dict[int, dict]:
    """The messages that carry a recorded insertion, with it applied: index -> message."""
    edited: dict[int, dict] = {}
    for key, text in book.items():
        k = int(key.split(":", 1)[0])
        if k < len(messages) and k not in edited and fingerprint(k, messages[k]) == key:
            edited[k] = apply(messages[k], text)
    return edited


def restatement(lines: list[str]) -> str:
    return OPEN + "\n".join(line + SUPERSEDES for line in lines) + CLOSE


def append_block(message: dict, text: str) -> dict:
    """A restatement after the message: a suffix of string content, else its own text part."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content + text}
    parts = list(content or ())        # a user or tool turn: string content, or a list of parts
    return {**message, "content": [*parts, {"type": "text", "text": text.lstrip("\n")}]}


def ends_with_block(message: dict, text: str) -> bool:
    content = message.get("content")
    if isinstance(content, str):
        return content.endswith(text)
    last = content[-1] if content else None
    return isinstance(last, dict) and last.get("text") == text.lstrip("\n")


def last_text(message: Any) -> str | None:
    """The text a trailing reminder is appended to: string content, or the last text part."""
    if not isinstance(message, dict):
        return None
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[-1], dict) \
            and content[-1].get("type") == "text" and isinstance(content[-1].get("text"), str):
        return content[-1]["text"]
    return None


def append_text(message: dict, suffix: str) -> dict:
    """`message` with `suffix` appended to its last text, byte for byte."""
    content = message["content"]
    if isinstance(content, str):
        return {**message, "content": content + suffix}
    last = content[-1]
    return {**message, "content": [*content[:-1], {**last, "text": last["text"] + suffix}]}


def dropped(messages: list, tail: tuple[int, dict] | None, system: str) -> tuple[int, str] | None:
    """(index, suffix) when the client's newest message of the previous request, `tail`, is
    back as history without a trailing reminder it had then, and otherwise unchanged."""
    if tail is None:
        return None
    k, old = tail
    if k >= len(messages) - 1 or not isinstance(messages[k], dict):
        return None
    was, now = last_text(old), last_text(messages[k])
    if was is None or now is None:
        return None
    suffix = dropped_reminder(was, now, last_text(messages[-1]) or "", system)
    if suffix is None or append_text(messages[k], suffix) != old:
        return None
    return k, suffix


def restore_reminders(messages: list, kept: dict[str, str], tail: tuple[int, dict] | None,
                      system: str) -> tuple[dict[int, dict], tuple[str, str] | None]:
    """`keep_trailing_reminder`: older messages with the trailing reminders the client dropped
    from them put back, the ones put back on earlier requests (`kept`, replayed) and the one
    dropped since the last request (`tail`, the client's newest user message then): index ->
    message, and (fingerprint, reminder) to record for the new one."""
    edited = replay(messages, kept, append_text)
    fresh = dropped(messages, tail, system)
    if fresh is None or fresh[0] in edited:
        return edited, None
    k, suffix = fresh
    edited[k] = append_text(messages[k], suffix)
    return edited, (fingerprint(k, messages[k]), suffix)
