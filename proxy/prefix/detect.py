"""Mutation detection: where and why a request's segments diverge from its lane's previous
request (docs/MUTATIONS.md §7.2). Pure: segments in, a `Diff` out; no tokens, no I/O.

The first differing segment gives region, path and character offset; inside it a line diff
(capped at 64 KB) gives up to three spans, each labelled from the volatile catalogue. An
append is checked against the response prefixd recorded (echo drift). Character counts are
turned into tokens by the caller, which knows the lane's chars-per-token ratio.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from prefixd.proxy.prefix import history as H
from prefixd.proxy.prefix import patterns as P
from prefixd.proxy.prefix.segments import (
    Segment,
    canonical,
    collapse_ws,
    rendered_chars,
    tool_name,
)

_ORDER = {"model": 0, "params": 1, "tools": 2, "system": 3, "messages": 4}
_DIFF_CAP = 64 * 1024
BOUNDARY_TOKENS = 16


class Verdict(StrEnum):
    NEW = "NEW"
    IDENTICAL = "IDENTICAL"
    APPEND = "APPEND"
    APPEND_ECHO_DRIFT = "APPEND+ECHO_DRIFT"
    BOUNDARY = "BOUNDARY"
    MUTATED = "MUTATED"
    TRUNCATED = "TRUNCATED"
    BRANCH = "BRANCH"


# Verdicts where the backend should reuse the whole previous prompt.
REUSING = (Verdict.IDENTICAL, Verdict.APPEND, Verdict.APPEND_ECHO_DRIFT, Verdict.BOUNDARY)


@dataclass(slots=True)
class Span:
    path: str
    char_offset: int
    old: str
    new: str
    causes: list[str]


@dataclass(slots=True)
class Diff:
    verdict: Verdict
    region: str = ""
    path: str = ""
    char_offset: int = 0
    causes: list[str] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    reusable_chars: int = 0        # rendered chars before the divergence
    prev_chars: int = 0            # rendered chars of the previous request
    echo_lost_chars: int = 0
    moved_from: str | None = None
    moved_to: str | None = None
    tools_added: list[str] = field(default_factory=list)
    tools_removed: list[str] = field(default_factory=list)


def _same(a: Segment, b: Segment) -> bool:
    return a.path == b.path and a.kind == b.kind and a.role == b.role and a.text == b.text


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:          # binary search on slice equality: C-speed compares
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def diff(prev: list[Segment] | None, new: list[Segment], prev_resp: dict | None = None,
         ratio: float = 4.0) -> Diff:
    """Compare `new` with the lane's previous request `prev`.

    Template parameters are not part of the prompt's bytes: when only they changed, the
    verdict follows the prompt (an append stays an APPEND) and `params_changed` is one more,
    informational cause. A template that renders a parameter shows up in the backend's
    cached tokens instead (an unexplained miss)."""
    if prev is None:
        return Diff(Verdict.NEW, prev_chars=0)
    if _params(prev) == _params(new):
        return _diff(prev, new, prev_resp, ratio)
    d = _diff([s for s in prev if s.region != "params"], [s for s in new if s.region != "params"],
              prev_resp, ratio)
    d.causes.append("params_changed")
    return d


def _params(segs: list[Segment]) -> str | None:
    return next((s.text for s in segs[:2] if s.region == "params"), None)


def _diff(prev: list[Segment], new: list[Segment], prev_resp: dict | None,
          ratio: float) -> Diff:
    prev_chars = rendered_chars(prev)
    n = min(len(prev), len(new))
    i = next((j for j in range(n) if not _same(prev[j], new[j])), n)
    before = rendered_chars(prev[:i])
    if i == len(prev):
        d = Diff(Verdict.IDENTICAL if i == len(new) else Verdict.APPEND,
                 reusable_chars=prev_chars, prev_chars=prev_chars)
        if d.verdict is Verdict.APPEND and prev_resp is not None:
            _echo(d, prev, new[i:], prev_resp)
        return d
    if i == len(new):
        return Diff(Verdict.TRUNCATED, "messages", prev[i].path, 0, ["history_truncated"],
                    reusable_chars=before, prev_chars=prev_chars)
    a, b = prev[i], new[i]
    if a.kind == b.kind == "prompt" and b.text.startswith(a.text):
        return Diff(Verdict.APPEND, reusable_chars=prev_chars, prev_chars=prev_chars)
    off = _common_prefix(a.text, b.text) if a.path == b.path and a.kind == b.kind else 0
    region = min(a.region, b.region, key=_ORDER.__getitem__)
    d = Diff(Verdict.MUTATED, region, a.path if a.region == region else b.path, off,
             reusable_chars=before + (off if a.rendered else 0), prev_chars=prev_chars)
    if region == "model":
        d.causes = ["model_changed"]
    elif region == "tools":
        _classify_tools(d, prev, new)
    elif region == "system":
        d.spans = text_spans(a, b) if a.path == b.path else [Span(d.path, 0, a.text, b.text, [])]
        for s in d.spans:      # retrieved context (RAG) and edits carry no catalogue label
            s.causes = s.causes or ["system_changed:unknown"]
        d.causes = _merge([c for s in d.spans for c in s.causes])
    else:
        _classify_messages(d, prev, new, i)
    lost = prev_chars - d.reusable_chars
    if (d.verdict in (Verdict.MUTATED, Verdict.BRANCH) and a.msg is not None
            and a.msg == prev[-1].msg and lost <= BOUNDARY_TOKENS * ratio):
        d.verdict = Verdict.BOUNDARY
    return d


def _merge(causes: list[str]) -> list[str]:
    return list(dict.fromkeys(causes))


def text_spans(a: Segment, b: Segment, limit: int = 3) -> list[Span]:
    """Up to `limit` changed spans between two versions of one text, widened to lines and
    labelled from the catalogue."""
    old, new = a.text, b.text
    if old.split() == new.split():
        off = _common_prefix(old, new)
        return [Span(a.path, off, P.widen_to_lines(old, off, off), P.widen_to_lines(new, off, off),
                     ["whitespace_only"])]
    if len(old) + len(new) > _DIFF_CAP:
        off = _common_prefix(old, new)
        tail = _common_prefix(old[off:][::-1], new[off:][::-1])
        spans = [(off, len(old) - tail, off, len(new) - tail)]
    else:
        spans = _line_spans(old, new)[:limit]
    out = []
    for a0, a1, b0, b1 in spans:
        o, w = P.widen_to_lines(old, a0, a1), P.widen_to_lines(new, b0, b1)
        causes = P.span_labels(o, w)
        for block in ("env_block", "repo_map"):
            if _inside(block, old, a0) or _inside(block, new, b0):
                causes.append(block)
        out.append(Span(a.path, a0 + _common_prefix(old[a0:a1], new[b0:b1]), o, w, causes))
    return out


def _line_spans(old: str, new: str) -> list[tuple[int, int, int, int]]:
    la, lb = old.splitlines(keepends=True), new.splitlines(keepends=True)
    ca, cb = [0], [0]
    for line in la:
        ca.append(ca[-1] + len(line))
    for line in lb:
        cb.append(cb[-1] + len(line))
    sm = difflib.SequenceMatcher(None, la, lb, autojunk=False)
    return [(ca[i1], ca[i2], cb[j1], cb[j2])
            for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal"]


def _inside(label: str, text: str, pos: int) -> bool:
    return any(m.start() <= pos < m.end() for m in P.VOLATILE[label].finditer(text))


def _classify_tools(d: Diff, prev: list[Segment], new: list[Segment]) -> None:
    old = {tool_name(json.loads(s.text)): s.text for s in prev if s.region == "tools"}
    cur = {tool_name(json.loads(s.text)): s.text for s in new if s.region == "tools"}
    d.tools_added = [t for t in cur if t not in old]
    d.tools_removed = [t for t in old if t not in cur]
    causes = []
    if d.tools_added:
        causes.append("tools_added")
    if d.tools_removed:
        causes.append("tools_removed")
    common_old = [t for t in old if t in cur]
    if common_old != [t for t in cur if t in old]:
        causes.append("tools_reordered")
    for name in common_old:
        x, y = old[name], cur[name]
        if x == y:
            continue
        vx, vy = json.loads(x), json.loads(y)
        if canonical(vx) == canonical(vy):
            causes.append("schema_key_order")
        elif canonical(collapse_ws(vx)) == canonical(collapse_ws(vy)):
            causes.append("schema_whitespace")
        else:
            causes.append("schema_changed")
    d.causes = _merge(causes) or ["schema_changed"]


def _classify_messages(d: Diff, prev: list[Segment], new: list[Segment], i: int) -> None:
    a, b = prev[i], new[i]
    same_slot = a.path == b.path and a.kind == b.kind
    moved = H.moved_block(prev, new, i)
    if moved is not None:
        d.moved_from, d.moved_to, label = moved
        reminder = ["system_reminder_moved"] if label == "system_reminder" else []
        d.causes = ["block_moved", *reminder]
    elif same_slot and H.pruned(a, b):     # the agent shortened its own history: not BRANCH
        d.verdict, d.causes = Verdict.TRUNCATED, ["tool_output_pruned"]
    elif same_slot and H.reserialized(a, b):
        d.causes = ["tool_args_reserialized"]
    elif H.reminder_dropped(prev, new, i):
        d.causes = ["trailing_reminder_dropped"]
    elif cause := H.files_block_change(prev, new, i):
        d.causes = [cause]
    elif H.compacted(prev, new, i):
        d.verdict, d.causes = Verdict.TRUNCATED, ["history_compacted"]
    if d.causes:
        d.spans = [Span(a.path, d.char_offset, a.text[:200], b.text[:200], list(d.causes))]
        return
    n_prev, n_new = (prev[-1].msg or 0) + 1, (new[-1].msg or 0) + 1
    spans = text_spans(a, b) if same_slot else [Span(b.path, 0, a.text, b.text, [])]
    d.spans = spans
    labels = _merge([c for s in spans for c in s.causes])
    if b.role == "user" and (not labels or b.msg == new[-1].msg):
        d.verdict, d.causes = Verdict.BRANCH, ["branch_edit"]
    elif n_new < n_prev and not labels:
        d.verdict, d.causes = Verdict.TRUNCATED, ["history_truncated"]
    else:
        d.causes = labels or ["messages_changed:unknown"]


def _echo(d: Diff, prev: list[Segment], added: list[Segment], resp: dict) -> None:
    """Compare the echoed assistant turn (first message after the previous request) with the
    response prefixd recorded for it."""
    first = added[0].msg if added else None
    segs = [s for s in added if s.msg == first and s.msg is not None]
    if not segs or segs[0].role != "assistant":
        return
    content = "".join(s.text for s in segs if s.kind == "text")
    echoed_reasoning = "".join(s.text for s in segs if s.kind == "reasoning")
    got = answer if isinstance(answer := resp.get("content"), str) else ""
    reasoning = resp.get("reasoning_content") or resp.get("reasoning") or ""
    think = P.THINK.search(got)
    if think:
        reasoning = reasoning or think.group(0)
    causes = []
    if reasoning and not echoed_reasoning and not P.THINK.search(content):
        causes.append("reasoning_dropped")
        d.echo_lost_chars += len(reasoning)
    plain_got, plain_echo = P.THINK.sub("", got), P.THINK.sub("", content)
    if plain_got != plain_echo:
        causes.append("whitespace_trimmed" if plain_got.strip() == plain_echo.strip()
                      else "content_edited")
        d.echo_lost_chars += len(plain_got)
    calls = [json.loads(s.text) for s in segs if s.kind == "tool_call"]
    for want, have in zip(resp.get("tool_calls") or [], calls, strict=False):
        causes.extend(_call_drift(want, have))
    if causes:
        d.verdict, d.causes = Verdict.APPEND_ECHO_DRIFT, _merge(causes)
        d.path = segs[0].path
        d.region = "messages"


def _call_drift(want: Any, have: Any) -> list[str]:
    try:
        wa, ha = want["function"]["arguments"], have["function"]["arguments"]
    except (KeyError, TypeError):
        return []
    if wa == ha:
        return []
    try:
        same = json.loads(wa) == json.loads(ha)
    except (TypeError, ValueError):
        same = False
    return ["tool_args_reserialized" if same else "content_edited"]
