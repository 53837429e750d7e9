"""What a user sees of a prefix comparison (docs/MUTATIONS.md §7.3): the `PrefixReport`, its
JSON form for /debug/prefix (prompt excerpts only when `prefix_excerpts` is on; hashes and
offsets otherwise), the `X-Prefixd-Prefix` header value and the log line with its indented
details (logger `prefixd.prefix`).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

from prefixd.proxy.prefix.detect import REUSING, Verdict
from prefixd.proxy.prefix.rules import hint

_EXCERPT = 120


@dataclass(slots=True)
class SpanReport:
    path: str
    char_offset: int
    causes: list[str]
    old_hash: str
    new_hash: str
    old_excerpt: str | None = None
    new_excerpt: str | None = None


@dataclass(slots=True)
class PrefixReport:
    lane: str
    turn: int
    client: str
    verdict: Verdict
    region: str = ""
    path: str = ""
    char_offset: int = 0
    token_offset: int = 0
    token_offset_exact: bool = False
    causes: list[str] = field(default_factory=list)
    spans: list[SpanReport] = field(default_factory=list)
    moved_from: str | None = None
    moved_to: str | None = None
    tools_added: list[str] = field(default_factory=list)
    tools_removed: list[str] = field(default_factory=list)
    reusable_tokens: int = 0
    prev_prompt_tokens: int = 0
    lost_tokens: int = 0
    sent_verdict: Verdict = Verdict.NEW      # what the backend received, after the rules
    fixed: list[str] = field(default_factory=list)           # rules that rewrote this request
    saved_tokens: int = 0                                    # kept thanks to those rules
    would_fix: list[dict[str, Any]] = field(default_factory=list)   # rules not on
    predicted_cached_tokens: int | None = None   # what routing expected the backend to hold
    predicted_from: str | None = None   # what taught it: "answers" through prefixd, "kv_events"
    backend_cached_tokens: int | None = None
    backend_breakdown: dict[str, Any] | None = None   # a prefixd worker's per-turn timings
    backend_prompt_tokens: int | None = None
    miss: str | None = None   # "agrees", "unexplained", or "worker:<reason>" (a prefixd
    #                           worker's own reason: evicted, disk_evicted, write_pending, ...)
    suspects: list[str] = field(default_factory=list)
    hint: str | None = None

    @property
    def mutated(self) -> bool:
        """The client's request broke the prefix (whether or not a rule repaired it)."""
        return self.verdict not in (*REUSING, Verdict.NEW)

    @property
    def sent_mutated(self) -> bool:
        """What the backend received breaks the prefix."""
        return self.sent_verdict not in (*REUSING, Verdict.NEW)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def excerpt_pair(old: str, new: str) -> tuple[str, str]:
    """Short old/new excerpts around where they start to differ."""
    n = 0
    for x, y in zip(old, new, strict=False):
        if x != y:
            break
        n += 1
    start = max(0, n - 40)
    lead = "…" if start else ""
    return lead + old[start:start + _EXCERPT], lead + new[start:start + _EXCERPT]


def span_report(path: str, offset: int, old: str, new: str, causes: list[str],
                excerpts: bool) -> SpanReport:
    h = hashlib.sha1
    sr = SpanReport(path, offset, causes, h(old.encode()).hexdigest()[:12],
                    h(new.encode()).hexdigest()[:12])
    if excerpts:
        sr.old_excerpt, sr.new_excerpt = excerpt_pair(old, new)
    return sr


def hint_for(causes: list[str]) -> str | None:
    """The hint of the first cause that has one (`rules.hint`)."""
    return next((h for c in causes if (h := hint(c)) is not None), None)


def header(r: PrefixReport, served: bool = True) -> str:
    """`X-Prefixd-Prefix` value: the client's verdict and causes, the rules that repaired it,
    the verdict of what was sent, reused/previous tokens, where, rules that would help. A
    request no backend accepted reused nothing and is no turn: `served=0` in place of the
    token counts."""
    parts = [f"verdict={r.verdict.value}", f"cause={','.join(r.causes) or '-'}"]
    if r.fixed:
        parts.append(f"fixed={','.join(r.fixed)}")
    parts.append(f"sent={r.sent_verdict.value}")
    if not served:
        return ";".join([*parts, "served=0"])
    parts.append(f"reused={r.reusable_tokens}/{r.prev_prompt_tokens}")
    if r.predicted_cached_tokens is not None:
        parts.append(f"predicted={r.predicted_cached_tokens}")
    if r.path:
        tok = f"{'' if r.token_offset_exact else '~'}{r.token_offset}"
        parts.append(f"at={r.path}+{r.char_offset}ch@{tok}tok")
    if r.would_fix:
        parts.append(f"would_fix={','.join(w['rule'] for w in r.would_fix)}")
    return ";".join(parts)


def log_text(r: PrefixReport, est_prefill_s: float | None = None) -> str:
    """One line, details indented below it."""
    where = ""
    if r.path:
        approx = "" if r.token_offset_exact else "~"
        where = f" at={r.path}+{r.char_offset}ch ({approx}tok {r.token_offset})"
    cause = f" cause={','.join(r.causes)}" if r.causes else ""
    if r.moved_from:
        cause += f"(from {r.moved_from})"
    sent = f" sent={r.sent_verdict.value}" if r.sent_verdict != r.verdict else ""
    lines = [f"prefix lane={r.lane} turn={r.turn} client={r.client} "
             f"verdict={r.verdict.value}{where}{cause}{sent}"]
    pct = 100.0 * r.reusable_tokens / r.prev_prompt_tokens if r.prev_prompt_tokens else 100.0
    detail = f"  reusable={r.reusable_tokens}/{r.prev_prompt_tokens} tok ({pct:.1f}%)"
    if r.lost_tokens:
        detail += f" lost≈{r.lost_tokens} tok"
        if est_prefill_s is not None:
            detail += f" ≈{est_prefill_s:.1f}s prefill"
    if r.backend_cached_tokens is not None:
        detail += f"  backend_cached={r.backend_cached_tokens} ({r.miss or 'agrees'})"
    lines.append(detail)
    if r.suspects:
        lines.append(f"  unexplained miss, suspects: {', '.join(r.suspects)}")
    if r.tools_added or r.tools_removed:
        lines.append(f"  tools added={r.tools_added} removed={r.tools_removed}")
    for s in r.spans:
        lines.append(f"  span {s.path}+{s.char_offset}ch {','.join(s.causes) or '?'} "
                     f"old#{s.old_hash} new#{s.new_hash}")
        if s.old_excerpt is not None:
            lines.append(f"    - old: {s.old_excerpt!r}")
            lines.append(f"    + new: {s.new_excerpt!r}")
    if r.fixed:
        lines.append(f"  fixed by: {', '.join(r.fixed)} (kept {r.saved_tokens} tok)")
    for w in r.would_fix:
        lines.append(f"  fix: canon_{w['rule']}=on ({w['mode']} now) would keep "
                     f"{w['saved_tokens']} more tok")
    if r.hint:
        lines.append(f"  hint: {r.hint}")
    return "\n".join(lines)
