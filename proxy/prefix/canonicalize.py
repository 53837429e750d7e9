"""Canonicalization (docs/MUTATIONS.md §7.4): opt-in rewrites that keep a lane's prompt prefix
byte-stable while the model is still told every live value. The rules are the entries of
`rules.RULES`; this module runs the steps of those that are on, and names none of them:
re-append what the client dropped from older messages, rewrite system texts, pin system
texts (whole, then line by line), pin tools, then replay and add restatements.

Principles, enforced here: lazy (a rule acts only once its value changed within the lane;
the first request only sets the baseline, apart from a rewrite such as the billing-header
strip); sticky (pin to the lane's first-seen bytes, never to "now"); semantics kept (a
pinned value is restated in the newest user/tool message with "supersedes" wording, never as
a second system message, and only when it changed since its last restatement); replayable
(insertions, in `insertions`, are re-applied byte-identically when their message is
history); deterministic and idempotent. Pure: `canonicalize` reads `CanonState`, `commit` is
the only writer.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from prefixd.proxy.prefix import insertions as I
from prefixd.proxy.prefix import patterns as P
from prefixd.proxy.prefix import rules as R
from prefixd.proxy.prefix.rules import Rule
from prefixd.proxy.prefix.segments import (
    Segment,
    dumps,
    replace_texts,
    system_segments,
    tool_name,
    without_cache_control,
)


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


def canonicalize(body: dict, state: CanonState, enabled: Collection[str], *,
                 shadow: bool = False) -> CanonResult:
    """The body to forward under the `enabled` rules (names of `rules.RULES`); `body` itself
    is never mutated."""
    res = CanonResult(body)
    on = R.enabled(enabled)
    book = state.shadow if shadow else state.live
    segs = system_segments(body)
    target = _target(body)
    out = _reappend(res, body, book, state.tail, "\n".join(s.text for s in segs), on)
    rewrites = [r for r in on if r.rewrite is not None]
    edits: dict[Any, str] = {}
    for s in segs:
        if s.region != "system" or s.loc is None:
            continue
        text = _rewrite(s.text, rewrites, res)
        base = (state.system or {}).get(s.path)
        if base is not None and (base := _rewrite(base, rewrites)) != text:
            text = _pin_system(res, s.path, base, text, on, book.said,
                               pin_values=target is not None)
        if text != s.text:
            edits[s.loc] = text
    out = replace_texts(out, edits) if edits else out
    if rewrites:
        out = _drop_emptied_parts(out, [loc for loc, text in edits.items() if not text.strip()])
    out = _pin_tools(res, out, state, on)
    out = _inject(res, out, book.blocks, target)
    res.body = out if res.applied else body
    return res


def _rewrite(text: str, rewrites: list[Rule], res: CanonResult | None = None) -> str:
    for r in rewrites:
        assert r.rewrite is not None
        new = r.rewrite(text)
        if new != text and res is not None:
            _note(res, r.name)
        text = new
    return text


def _reappend(res: CanonResult, body: dict, book: I.Book, tail: tuple[int, dict] | None,
              system: str, on: list[Rule]) -> dict:
    """Text the client dropped from older messages put back by the rules that do that."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return body
    for r in on:
        if r.reappend is None or not (book.kept or tail):
            continue
        edited, record = r.reappend(messages, book.kept, tail, system)
        if record is not None:
            res.kept = record
        if edited:
            _note(res, r.name)
            messages = [edited.get(k, m) for k, m in enumerate(messages)]
            body = {**body, "messages": messages}
    return body


def _drop_emptied_parts(body: dict, emptied: list[Any]) -> dict:
    """Remove the text parts a rewrite left empty (a part that is only the billing header
    line), keeping at least one part per message."""
    out = body
    for loc in sorted(emptied, reverse=True):      # later parts first: indices stay valid
        if loc[0] == "messages" and len(loc) == 5:
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


def _pin_system(res: CanonResult, path: str, base: str, text: str, on: list[Rule],
                said: dict[str, str], pin_values: bool) -> str:
    """`text` pinned back to `base` as a whole (whitespace-only changes) or line by line
    (value-only changes). A pinned line's live value is restated unless it is what the last
    restatement (`said`) said."""
    same = next((r for r in on if r.same_text is not None and r.same_text(base, text)), None)
    if same is not None:
        _note(res, same.name)
        return base
    if not pin_values or not any(r.values or r.pins_line is not None for r in on):
        return text
    lb, ln = base.splitlines(keepends=True), text.splitlines(keepends=True)
    out = list(ln)
    env_lines = _env_line_set(ln)
    sm = difflib.SequenceMatcher(None, lb, ln, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag != "replace" or i2 - i1 != j2 - j1:
            continue
        for bi, nj in zip(range(i1, i2), range(j1, j2), strict=True):
            rules = pin_rules(lb[bi], ln[nj], on, in_env=nj in env_lines)
            if rules:
                out[nj] = lb[bi]
                for r in rules:
                    _note(res, r.name)
                key, live = f"{path}|{lb[bi].strip()}", ln[nj].strip()
                if said.get(key) != live:
                    res.restated.append(live)
                    res.said[key] = live
    return "".join(out)


def pin_rules(old: str, new: str, on: list[Rule], in_env: bool = False) -> list[Rule]:
    """The rules that are on and together explain the change from line `old` to `new`: the
    value rules whose values are all that changed (each credited if its values changed), or
    else the first rule that pins such a line whatever changed in it."""
    valued = [r for r in on if r.values]
    labels = tuple(label for r in valued for label in r.values)
    if labels and P.mask(old, labels) == P.mask(new, labels):
        return sorted((r for r in valued if P.mask(old, r.values) != old
                       and any(P.VOLATILE[label].findall(old) != P.VOLATILE[label].findall(new)
                               for label in r.values)), key=R.credit_order)
    return [r for r in on if r.pins_line is not None and r.pins_line(old, in_env)][:1]


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


def _pin_tools(res: CanonResult, body: dict, state: CanonState, on: list[Rule]) -> dict:
    tools = body.get("tools")
    if not isinstance(tools, list):
        return body
    base = state.tools or []
    by_name = {tool_name(t): (i, t) for i, t in enumerate(base)}
    res.new_tools = [t for t in tools if tool_name(t) not in by_name]
    same_tool = [r for r in on if r.same_tool is not None]
    ordering = [r for r in on if r.orders_tools]
    if state.tools is None or not (same_tool or ordering):
        return body
    chosen = []
    for t in tools:
        _, b = by_name.get(tool_name(t), (None, None))
        if b is not None and dumps(b) != dumps(t):
            x, y = without_cache_control(b), without_cache_control(t)
            same = next((r for r in same_tool if r.same_tool is not None and r.same_tool(x, y)),
                        None)
            if same is not None:
                _note(res, same.name)
                t = b
        chosen.append(t)
    if ordering:
        order = {id(t): by_name.get(tool_name(t), (len(base) + k, None))[0]
                 for k, t in enumerate(chosen)}
        ordered = sorted(chosen, key=lambda t: order[id(t)])
        if [id(t) for t in ordered] != [id(t) for t in chosen]:
            for r in ordering:
                _note(res, r.name)
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
        state.tail = None
        if isinstance(messages, list) and messages:
            last = messages[-1]
            if isinstance(last, dict) and last.get("role") == "user" \
                    and I.last_text(last) is not None:
                state.tail = (len(messages) - 1, last)
    book = state.shadow if shadow else state.live
    if res.injection is not None:
        book.record(book.blocks, *res.injection)
        for key, value in res.said.items():
            book.record(book.said, key, value)
    if res.kept is not None:
        book.record(book.kept, *res.kept)


def _is_system_text(s: Segment) -> bool:
    return s.region == "system" and s.loc is not None
