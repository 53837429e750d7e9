"""Canonicalization rules (docs/MUTATIONS.md §7.4): opt-in rewrites that keep a lane's prompt
prefix byte-stable while the model is still told every live value.

Principles, enforced here: lazy (a rule acts only once its value changed within the lane;
the first request only sets the baseline, apart from the always-safe billing-header strip);
sticky (pin to the lane's first-seen bytes, never to "now"); semantics kept (a pinned value
is restated in the newest user/tool message with "supersedes" wording, never as a second
system message); replayable (each insertion is recorded with the fingerprint of the message
it went into and re-applied byte-identically when that message is history); deterministic
and idempotent. A pinned value is restated only when it changed since its last
restatement. `keep_trailing_reminder` re-appends a reminder the client dropped from an older
message (Aider). Insertions and their replay live in `insertions`. Pure: `canonicalize` reads
`CanonState`, `commit` is the only writer.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from prefixd.proxy.prefix import insertions as I
from prefixd.proxy.prefix import patterns as P
from prefixd.proxy.prefix.segments import (
    Segment,
    canonical,
    collapse_ws,
    dumps,
    replace_texts,
    system_segments,
    tool_name,
    without_cache_control,
)

STRIP, TOOLS, WS = "strip_billing_header", "pin_tool_order", "pin_whitespace"
DATE, TIME, ENV = "freeze_date", "relocate_clock_time", "pin_env_block"
KEEP = "keep_trailing_reminder"
RULES = (STRIP, TOOLS, WS, DATE, TIME, ENV, KEEP)
_PIN_LABELS = {DATE: P.DATE_LABELS, TIME: P.TIME_LABELS}


@dataclass(slots=True)
class CanonState:
    """A lane's canonicalization memory."""

    system: dict[str, str] | None = None     # first-seen system texts by path, as sent
    tools: list[Any] | None = None           # first-seen tools, first-seen order
    tail: tuple[int, dict] | None = None     # the client's newest user message, last request
    live: I.Book = field(default_factory=I.Book)      # insertions forwarded
    shadow: I.Book = field(default_factory=I.Book)    # the same, dry-run view

    def nbytes(self) -> int:
        tail = len(I.last_text(self.tail[1]) or "") if self.tail else 0
        return (tail + sum(len(t) for t in (self.system or {}).values()) + self.live.nbytes()
                + self.shadow.nbytes() + sum(len(dumps(t)) for t in self.tools or ()))


@dataclass(slots=True)
class CanonResult:
    body: dict
    applied: list[str] = field(default_factory=list)     # rules that changed bytes
    restated: list[str] = field(default_factory=list)    # live lines restated in the tail
    said: dict[str, str] = field(default_factory=dict)   # their pinned line -> value
    injection: tuple[str, str] | None = None             # (fingerprint, text) to record
    kept: tuple[str, str] | None = None                  # (fingerprint, reminder) to record
    new_tools: list[Any] = field(default_factory=list)   # tools seen for the first time

    @property
    def changed(self) -> bool:
        return bool(self.applied)


def strip_billing(text: str) -> str:
    return P.VOLATILE["anthropic_billing_header"].sub("", text)


def canonicalize(body: dict, state: CanonState, enabled: frozenset[str], *,
                 shadow: bool = False, backend_kind: str = "local") -> CanonResult:
    """The body to forward under the `enabled` rules; `body` itself is never mutated."""
    res = CanonResult(body)
    book = state.shadow if shadow else state.live
    strip = STRIP in enabled and backend_kind != "anthropic"
    segs = system_segments(body)
    target = _target(body)
    out = _keep_reminders(res, body, book, state.tail if KEEP in enabled else None,
                          "\n".join(s.text for s in segs))
    edits: dict[Any, str] = {}
    for s in segs:
        if s.region != "system" or s.loc is None:
            continue
        text = strip_billing(s.text) if strip else s.text
        if text != s.text:
            _note(res, STRIP)
        base = (state.system or {}).get(s.path)
        if base is not None and (base := strip_billing(base) if strip else base) != text:
            text = _pin_system(res, s.path, base, text, enabled, book.said,
                               pin_values=target is not None)
        if text != s.text:
            edits[s.loc] = text
    out = replace_texts(out, edits) if edits else out
    if strip:
        out = _drop_emptied_parts(out, [loc for loc, text in edits.items() if not text.strip()])
    out = _pin_tools(res, out, state, enabled)
    out = _inject(res, out, book.blocks, target)
    res.body = out if res.applied else body
    return res


def _keep_reminders(res: CanonResult, body: dict, book: I.Book, tail: tuple[int, dict] | None,
                    system: str) -> dict:
    """Older messages with the trailing reminders the client dropped from them put back:
    the ones kept on earlier requests, and the one dropped since the last request (`tail`,
    given only when the rule is enabled)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not (book.kept or tail):
        return body
    edited = I.replay(messages, book.kept, I.append_text)
    fresh = I.dropped(messages, tail, system)
    if fresh is not None and fresh[0] not in edited:
        k, suffix = fresh
        res.kept = (I.fingerprint(k, messages[k]), suffix)
        edited[k] = I.append_text(messages[k], suffix)
    if not edited:
        return body
    _note(res, KEEP)
    return {**body, "messages": [edited.get(k, m) for k, m in enumerate(messages)]}


def _drop_emptied_parts(body: dict, emptied: list[Any]) -> dict:
    """Remove the text blocks/parts the billing strip left empty (a part that is only the
    header line), keeping at least one part per message."""
    out = body
    for loc in sorted(emptied, reverse=True):      # later parts first: indices stay valid
        if loc[0] == "system" and len(loc) == 3 and isinstance(out.get("system"), list):
            out = {**out, "system": [b for j, b in enumerate(out["system"]) if j != loc[1]]}
        elif loc[0] == "messages" and len(loc) == 5:
            messages = list(out["messages"])
            msg = messages[loc[1]]
            if isinstance(msg.get("content"), list) and len(msg["content"]) > 1:
                parts = [q for j, q in enumerate(msg["content"]) if j != loc[3]]
                messages[loc[1]] = {**msg, "content": parts}
                out = {**out, "messages": messages}
    return out


def _note(res: CanonResult, rule: str) -> None:
    if rule not in res.applied:
        res.applied.append(rule)


def _target(body: dict) -> int | None:
    """Index of the newest message if a restatement may go there (a user or tool turn)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if isinstance(last, dict) and last.get("role") in ("user", "tool") and isinstance(
            last.get("content"), str | list):
        return len(messages) - 1
    return None


def _pin_system(res: CanonResult, path: str, base: str, text: str, enabled: frozenset[str],
                said: dict[str, str], pin_values: bool) -> str:
    """`text` with whitespace-only or value-only changes pinned back to `base`. A pinned
    line's live value is restated unless it is what the last restatement (`said`) said."""
    if WS in enabled and base.split() == text.split():
        _note(res, WS)
        return base
    if not pin_values or not enabled & {DATE, TIME, ENV}:
        return text
    lb, ln = base.splitlines(keepends=True), text.splitlines(keepends=True)
    out = list(ln)
    env_lines = _env_line_set(ln)
    sm = difflib.SequenceMatcher(None, lb, ln, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag != "replace" or i2 - i1 != j2 - j1:
            continue
        for bi, nj in zip(range(i1, i2), range(j1, j2), strict=True):
            rules = pin_rules(lb[bi], ln[nj], enabled, in_env=nj in env_lines)
            if rules:
                out[nj] = lb[bi]
                for r in rules:
                    _note(res, r)
                key, live = f"{path}|{lb[bi].strip()}", ln[nj].strip()
                if said.get(key) != live:
                    res.restated.append(live)
                    res.said[key] = live
    return "".join(out)


def pin_rules(old: str, new: str, enabled: frozenset[str], in_env: bool = False) -> list[str]:
    """The enabled rules that together explain the change from line `old` to `new`."""
    labels = tuple(lab for r in (DATE, TIME) if r in enabled for lab in _PIN_LABELS[r])
    if labels and P.mask(old, labels) == P.mask(new, labels):
        return [r for r in (TIME, DATE) if r in enabled
                and P.mask(old, _PIN_LABELS[r]) != old
                and any(x.findall(old) != x.findall(new)
                        for x in (P.VOLATILE[lab] for lab in _PIN_LABELS[r]))]
    if ENV in enabled and (in_env or any(P.VOLATILE[lab].search(old) for lab in P.ENV_LABELS)):
        return [ENV]
    return []


def _env_line_set(lines: list[str]) -> set[int]:
    """Indices of lines that lie inside an <env>-style block."""
    text = "".join(lines)
    blocks = [(m.start(), m.end()) for m in P.VOLATILE["env_block"].finditer(text)]
    out, pos = set(), 0
    for i, line in enumerate(lines):
        if any(a <= pos < b for a, b in blocks):
            out.add(i)
        pos += len(line)
    return out


def _pin_tools(res: CanonResult, body: dict, state: CanonState,
               enabled: frozenset[str]) -> dict:
    tools = body.get("tools")
    if not isinstance(tools, list):
        return body
    base = state.tools or []
    by_name = {tool_name(t): (i, t) for i, t in enumerate(base)}
    res.new_tools = [t for t in tools if tool_name(t) not in by_name]
    if state.tools is None or not enabled & {TOOLS, WS}:
        return body
    chosen = []
    for t in tools:
        _, b = by_name.get(tool_name(t), (None, None))
        if b is not None and dumps(b) != dumps(t):
            x, y = without_cache_control(b), without_cache_control(t)
            if TOOLS in enabled and canonical(x) == canonical(y):
                _note(res, TOOLS)
                t = b
            elif WS in enabled and canonical(collapse_ws(x)) == canonical(collapse_ws(y)):
                _note(res, WS)
                t = b
        chosen.append(t)
    if TOOLS in enabled:
        order = {id(t): by_name.get(tool_name(t), (len(base) + k, None))[0]
                 for k, t in enumerate(chosen)}
        ordered = sorted(chosen, key=lambda t: order[id(t)])
        if [id(t) for t in ordered] != [id(t) for t in chosen]:
            _note(res, TOOLS)
        chosen = ordered
    if [id(t) for t in chosen] == [id(t) for t in tools]:
        return body
    return {**body, "tools": chosen}


def _inject(res: CanonResult, body: dict, blocks: dict[str, str], target: int | None) -> dict:
    """Replay recorded restatements into history, then restate live values in the newest turn."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return body
    edited = I.replay(messages, blocks, I.append_block)
    if res.restated and target is not None and target not in edited:
        text = I.restatement(res.restated)
        m = messages[target]
        if not I.ends_with_block(m, text):
            edited[target] = I.append_block(m, text)
            res.injection = (I.fingerprint(target, m), text)
    if not edited:
        return body
    if any(edited[k] is not messages[k] for k in edited) and not res.applied:
        res.applied.append("replay")
    return {**body, "messages": [edited.get(k, m) for k, m in enumerate(messages)]}


def commit(state: CanonState, body: dict, res: CanonResult, *, shadow: bool = False) -> None:
    """Record what this request taught the lane: first-seen baselines, the client's newest
    user message, and the insertions."""
    if not shadow:
        if state.system is None:
            state.system = {s.path: s.text for s in system_segments(body) if _is_system_text(s)}
        if state.tools is None:
            tools = body.get("tools")
            state.tools = list(tools) if isinstance(tools, list) else []
        else:
            state.tools.extend(res.new_tools)
        messages = body.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        state.tail = ((len(messages) - 1, last) if isinstance(last, dict)
                      and last.get("role") == "user" and I.last_text(last) is not None else None)
    book = state.shadow if shadow else state.live
    if res.injection is not None:
        book.record(book.blocks, *res.injection)
        for key, value in res.said.items():
            book.record(book.said, key, value)
    if res.kept is not None:
        book.record(book.kept, *res.kept)


def _is_system_text(s: Segment) -> bool:
    return s.region == "system" and s.loc is not None
