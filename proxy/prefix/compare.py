"""One request against its lane's previous request, as a `PrefixReport`; and, after the answer,
the report against what the backend says it reused.

Two views are compared: the client's bytes against the client's previous bytes (what the
client changed: the verdict) and the forwarded bytes against the previous forwarded bytes
(what the backend sees: `sent_verdict`, the reusable tokens). Rules that are not on ran on a
third, shadow view, so `would_fix` says what enabling them would keep. Characters become
tokens through the lane's learned chars-per-token ratio until `measure` knows better.
Pure: reads the lane, writes only the report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prefixd.proxy.prefix.canonicalize import CanonResult
from prefixd.proxy.prefix.detect import BOUNDARY_TOKENS, REUSING, Diff, Verdict, diff
from prefixd.proxy.prefix.lanes import LaneState
from prefixd.proxy.prefix.report import PrefixReport, hint_for, span_report
from prefixd.proxy.prefix.segments import Segment


@dataclass(slots=True)
class Turn:
    """One request's scratch between the tracker's steps (canonicalize, detect, measure,
    record_response); the pipeline never sees it."""

    number: int                        # the lane's turn this request is (once served)
    client: str
    body: dict                         # as the client sent it
    raw: list[Segment]                 # its segments
    shadow: list[Segment] | None       # with every rule applied (dry run), if any is not on
    res: CanonResult
    shadow_res: CanonResult | None
    prev_body: dict | None             # the lane's previous request, as forwarded
    prev_tokens: list[int] | None      # its exact tokens, when measured
    prev_had_reasoning: bool           # the answer to it had reasoning
    tokens: list[int] | None = None    # this request's exact tokens as forwarded, if measured


def compare(lane: LaneState, t: Turn, fwd: list[Segment], hinted: Mapping[str, str],
            excerpts: bool) -> PrefixReport:
    """The report of this request (`fwd`: as forwarded) against the lane's previous one;
    `hinted`: the modes of the rules that are not on."""
    raw, shadow, shadow_res = t.raw, t.shadow, t.shadow_res
    sent = diff(lane.fwd, fwd, lane.resp, lane.ratio)
    same_views = fwd is raw and lane.fwd is lane.raw
    d = sent if same_views else diff(lane.raw, raw, lane.resp, lane.ratio)
    r = PrefixReport(lane.id, lane.turn, t.client, d.verdict, d.region, d.path, d.char_offset,
                     causes=d.causes, moved_from=d.moved_from, moved_to=d.moved_to,
                     tools_added=d.tools_added, tools_removed=d.tools_removed,
                     sent_verdict=sent.verdict)
    r.spans = [span_report(s.path, s.char_offset, s.old, s.new, s.causes, excerpts)
               for s in d.spans]
    _quantify(r, sent, d, lane)
    r.fixed = list(t.res.applied)
    r.saved_tokens = max(0, r.reusable_tokens - _reusable(d, lane))
    if (shadow_res is not None and shadow_res.changed and lane.shadow is not None
            and shadow is not None):
        sd = diff(lane.shadow, shadow, lane.resp, lane.ratio)
        gain = max(0, _reusable(sd, lane) - r.reusable_tokens)
        rules = [x for x in shadow_res.applied if x in hinted]
        if gain > 0:
            r.would_fix = [{"rule": x, "mode": hinted[x], "saved_tokens": gain} for x in rules]
    r.hint = hint_for(r.causes)
    return r


def _prev_tokens(d: Diff, lane: LaneState) -> int:
    if lane.prompt_tokens:
        return lane.prompt_tokens
    return round(d.prev_chars / lane.ratio)


def _reusable(d: Diff, lane: LaneState) -> int:
    prev = _prev_tokens(d, lane)
    if d.verdict in REUSING or d.verdict is Verdict.NEW:
        return prev
    return min(prev, round(d.reusable_chars / lane.ratio))


def _quantify(r: PrefixReport, sent: Diff, client: Diff, lane: LaneState) -> None:
    """Tokens the backend can reuse (from what was sent) and where the client broke the
    prefix (from what the client sent)."""
    if client.verdict is Verdict.NEW:
        return
    r.prev_prompt_tokens = _prev_tokens(sent, lane)
    r.reusable_tokens = _reusable(sent, lane)
    r.lost_tokens = r.prev_prompt_tokens - r.reusable_tokens
    if sent.verdict is Verdict.APPEND_ECHO_DRIFT:
        r.lost_tokens += round(sent.echo_lost_chars / lane.ratio)
    if r.path:
        r.token_offset = (_reusable(client, lane) if client.verdict not in REUSING
                          else r.prev_prompt_tokens)


def reconcile(r: PrefixReport, cached: int, prompt: int | None, prev_had_reasoning: bool) -> None:
    """The backend's cached prompt tokens against the reusable count: `miss` (agrees, the
    worker's own reason, or unexplained with suspects)."""
    r.backend_cached_tokens = cached
    r.backend_prompt_tokens = prompt
    expected = r.reusable_tokens
    slack = BOUNDARY_TOKENS if r.token_offset_exact else max(BOUNDARY_TOKENS,
                                                             int(0.1 * expected))
    if r.sent_verdict is Verdict.NEW or cached + slack >= expected:
        r.miss = "agrees"
        return
    worker = (r.backend_breakdown or {}).get("cache")
    reason = worker.get("miss") if isinstance(worker, dict) else None
    if isinstance(reason, str) and reason:
        r.miss = f"worker:{reason}"       # a prefixd worker said why (evicted, ...)
        return
    r.miss = "unexplained"
    if r.sent_verdict not in REUSING:
        # Reuse needs a rewind to mid-prompt: recurrent/windowed state without a
        # checkpoint there cannot be trimmed back (stock mlx-lm on hybrid models).
        r.suspects = ["checkpoint_granularity", "eviction"]
        return
    suspects = ["template"] if prev_had_reasoning else []
    suspects += ["eviction", "restart"] if cached == 0 else ["checkpoint_granularity",
                                                             "eviction"]
    r.suspects = suspects
