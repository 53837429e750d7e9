"""Classifying an edit of an older message (docs/MUTATIONS.md §7.2 step 5): a catalogue
block that moved to another message, a tool call re-serialized in other bytes, tool output
replaced by a placeholder, a trailing reminder the client keeps on its newest turn only,
Aider's chat-files block, and history compacted into a summary. Helpers of `detect`; pure
functions over segments, each looking at the first differing segment `prev[i]`/`new[i]`.
"""

from __future__ import annotations

import json
from typing import Any

from prefixd.proxy.prefix import patterns as P
from prefixd.proxy.prefix.segments import Segment, canonical

# Catalogue blocks whose moves are reported (by content: the same bytes elsewhere).
_BLOCKS = ("system_reminder", "env_block")


def moved_block(prev: list[Segment], new: list[Segment], i: int) -> tuple[str, str, str] | None:
    """A catalogue block (system reminder, env block), whole part or inside a text, that left
    the message diverging at `prev[i]` and now shows up in another message: (from, to, label).

    The block must be gone from that message and occur more often in the rest of the new
    request than in the rest of the old one, so a reminder repeated in every turn, or history
    that merely shifted (compaction), is not a move."""
    m = prev[i].msg
    if m is None:
        return None
    kept = "\x00".join(s.text for s in new[i:] if s.msg == m)
    old_rest = [s for s in prev[i:] if s.msg != m]
    new_rest = [s for s in new[i:] if s.msg != m]
    was = {s.path: s.text for s in old_rest}
    for src in (s for s in prev[i:] if s.msg == m):
        for label in _BLOCKS:
            for hit in P.VOLATILE[label].finditer(src.text):
                block = hit.group(0)
                if block in kept or (sum(s.text.count(block) for s in new_rest)
                                     <= sum(s.text.count(block) for s in old_rest)):
                    continue
                dest = [s.path for s in new_rest if block in s.text]
                fresh = [p for p in dest if block not in was.get(p, "")]
                return src.path, (fresh or dest)[0], label
    return None


def reserialized(a: Segment, b: Segment) -> bool:
    """An echoed tool call whose arguments are the same JSON value in other bytes."""
    if a.kind != "tool_call" or b.kind != "tool_call":
        return False
    return canonical(_parsed_args(json.loads(a.text))) == canonical(
        _parsed_args(json.loads(b.text)))


def _parsed_args(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except ValueError:
            return call
    return call


def pruned(a: Segment, b: Segment) -> bool:
    """An old tool output replaced by a placeholder, its message kept."""
    if any(mk in b.text and mk not in a.text for mk in P.CLEARED_MARKERS):
        return True
    tool_output = a.role == "tool" and a.kind == "text"
    if not tool_output or b.role != a.role or len(b.text) >= len(a.text):
        return False
    if len(a.text) >= 200 and len(b.text) * 4 < len(a.text):
        return True
    return (len(b.text) <= P.PLACEHOLDER_MAX and P.PLACEHOLDER.search(b.text) is not None
            and b.text.strip() not in a.text)


def _text(segs: list[Segment], msg: int | None) -> str:
    return "".join(s.text for s in segs if s.msg == msg and s.kind == "text")


def reminder_dropped(prev: list[Segment], new: list[Segment], i: int) -> bool:
    """An older message lost a trailing block that the client now puts on its newest message
    (Aider's edit-format reminder, `reminder: user`), or a trailing system message that moved
    on to the new end of the conversation (`reminder: sys`)."""
    a, b = prev[i], new[i]
    newest = new[-1].msg
    if a.msg is None or b.msg == newest:
        return False            # a change of the newest message is the user's
    if a.path == b.path and a.kind == b.kind == "text":
        system = "\n".join(s.text for s in new if s.region == "system")
        return P.dropped_reminder(a.text, b.text, _text(new, newest), system) is not None
    last = prev[-1].msg
    return (a.msg == last and prev[-1].role == new[-1].role == "system"
            and _text(prev, last) == _text(new, newest) != "")


def files_block_change(prev: list[Segment], new: list[Segment], i: int) -> str | None:
    """Aider's chat-files message (`files_content_prefix` + file contents) changed:
    `history_before_files` when history now stands where the block began (Aider moves its
    done messages ahead of it after an edit), `chat_files_changed` when the block is still
    there with other contents (a file edited, added or dropped)."""
    m = prev[i].msg
    if m is None or not P.FILES_BLOCK.match(old := _text(prev, m)):
        return None
    head = old.split("\n", 1)[0]
    if _text(new, new[i].msg).startswith(head):
        return "chat_files_changed"
    later = {s.msg for s in new[i:] if s.msg is not None and s.msg > m and s.kind == "text"
             and s.role == prev[i].role and s.text.startswith(head)}
    return "history_before_files" if later else None


def compacted(prev: list[Segment], new: list[Segment], i: int) -> bool:
    """History compaction: a run of old messages is gone and a new message with a summary
    (a known agent's preamble, or summary wording in a message that is not the newest) takes
    their place. The system prompt and any kept messages may stay."""
    m = prev[i].msg
    if m is None:
        return False
    old, cur = _messages(prev, m), _messages(new, m)
    seen, kept, newest = set(old.values()), set(cur.values()), new[-1].msg
    summary = any(t not in seen and (P.COMPACTION_PREAMBLE.search(t) or (
        k != newest and P.SUMMARY_MARKER.search(t))) for k, t in cur.items())
    return summary and sum(t not in kept for t in old.values()) >= 2


def _messages(segs: list[Segment], start: int) -> dict[int, str]:
    """Each message from index `start` on, as one text (meta, reasoning, parts, calls)."""
    out: dict[int, list[str]] = {}
    for s in segs:
        if s.msg is not None and s.msg >= start:
            out.setdefault(s.msg, []).append(s.text)
    return {k: "\n".join(v) for k, v in out.items()}
