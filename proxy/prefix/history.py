"""Classifying an edit of an older message (docs/MUTATIONS.md §7.2 step 5): a catalogue
block that moved to another message, a tool call re-serialized in other bytes, tool output
replaced by a placeholder. Helpers of `detect`; pure functions over segments.
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
    if any(mk in b.text and mk not in a.text for mk in P.CLEARED_MARKERS):
        return True
    tool_output = a.kind == "tool_result" or a.role == "tool"
    return tool_output and len(a.text) >= 200 and len(b.text) * 4 < len(a.text)
