"""The proxy's prefix stage: resolve the lane, canonicalize, diff against the lane's previous
request, report; later refine token offsets (`measure`) and reconcile with the backend's
`cached_tokens` (`record_response`).

Two views are compared: the client's bytes against the client's previous bytes (what the
client changed) and the forwarded bytes against the previous forwarded bytes (what the
backend sees: the verdict). Dry-run rules run on a third, shadow view, so `would_fix` says
what enabling them would keep. Owns the `LaneStore`; the proxy owns I/O and the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from prefixd.metrics import prefix as M
from prefixd.proxy.prefix import canonicalize as C
from prefixd.proxy.prefix.detect import BOUNDARY_TOKENS, REUSING, Diff, Verdict, diff
from prefixd.proxy.prefix.lanes import LaneState, LaneStore, base_key, state_bytes, system_family
from prefixd.proxy.prefix.observe import observe
from prefixd.proxy.prefix.patterns import THINK, client_family
from prefixd.proxy.prefix.report import PrefixReport, header, hint_for, span_report
from prefixd.proxy.prefix.segments import Segment, flatten, rendered_chars
from prefixd.proxy.settings import Settings

log = logging.getLogger("prefixd.prefix")

# rule -> Settings field
RULE_SETTINGS = {C.STRIP: "canon_strip_billing_header", C.TOOLS: "canon_pin_tool_order",
                 C.WS: "canon_pin_whitespace", C.DATE: "canon_freeze_date",
                 C.TIME: "canon_relocate_clock_time", C.ENV: "canon_pin_env_block",
                 C.KEEP: "canon_keep_trailing_reminder"}
Tokenize = Callable[[dict], Awaitable[list[int] | None]]


@dataclass(slots=True)
class Prepared:
    """One request's passage through the prefix steps; the pipeline reads lane, body,
    changed and header. `canonicalize()` fills the first part, `detect()` the report."""

    lane: str
    body: dict
    changed: bool
    report: PrefixReport | None = None
    header: str | None = None
    turn: int = 0
    segments: list[Segment] = field(default_factory=list)   # forwarded, in render order
    prev_body: dict | None = None
    prev_tokens: list[int] | None = None
    prev_had_reasoning: bool = False
    client: str = "other"
    raw: list[Segment] = field(default_factory=list)        # as the client sent it
    shadow: list[Segment] | None = None                     # with every rule applied
    res: C.CanonResult | None = None
    shadow_res: C.CanonResult | None = None


class PrefixStage:
    """Lanes, canonicalization and mutation reports over one `LaneStore`.

    `canonicalize()` runs on every request (the rules that are on); `detect()` only when
    prefix detection is on. `prepare()` is both, for callers that want one step."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.store = LaneStore(settings.lane_idle_s, settings.lane_max, settings.lane_max_bytes,
                               settings.prefix_history)
        self.ratio = 4.0            # chars per token, learned across lanes for new ones
        self.modes = {rule: getattr(settings, name) for rule, name in RULE_SETTINGS.items()}
        self.live = frozenset(r for r, m in self.modes.items() if m == "on")
        # Rules that are not on still run on a shadow copy, so a report can say what they
        # would keep (`would_fix`); dry_run rules are also counted in the metrics.
        self.hinted = frozenset(r for r in self.modes if r not in self.live)

    # --- before forwarding ------------------------------------------------------------------
    def prepare(self, body: dict, headers: Mapping[str, str], *, model: str = "", path: str = "",
                backend_kind: str = "local") -> Prepared:
        prepared = self.canonicalize(body, headers, backend_kind=backend_kind)
        if self.settings.prefix_detect:
            self.detect(prepared)
        return prepared

    def canonicalize(self, body: dict, headers: Mapping[str, str], *,
                     backend_kind: str = "local") -> Prepared:
        """The lane and the body to forward. Never raises: a body this step cannot read is
        forwarded untouched."""
        try:
            return self._canonicalize(body, headers, backend_kind)
        except Exception:
            log.warning("prefix stage skipped a request it could not read", exc_info=True)
            return Prepared("-", body, False)

    def _canonicalize(self, body: dict, headers: Mapping[str, str],
                      backend_kind: str) -> Prepared:
        client = client_family(headers)
        raw = flatten(body)
        lane = self.store.resolve(base_key(headers, body, raw, client), system_family(raw),
                                  self.clock())
        if lane.turn == 0:
            lane.ratio = self.ratio
        lane.turn += 1
        res = C.canonicalize(body, lane.canon, self.live, backend_kind=backend_kind)
        fwd = flatten(res.body) if res.changed else raw
        shadow_res, shadow = None, None
        if self.settings.prefix_detect and self.hinted:
            shadow_res = C.canonicalize(body, lane.canon, self.live | self.hinted, shadow=True,
                                        backend_kind=backend_kind)
            shadow = flatten(shadow_res.body) if shadow_res.changed else raw
        C.commit(lane.canon, body, res)
        if shadow_res is not None:
            C.commit(lane.canon, body, shadow_res, shadow=True)
        return Prepared(lane.id, res.body, res.changed, turn=lane.turn, segments=fwd,
                        prev_body=lane.fwd_body, prev_tokens=lane.fwd_tokens,
                        prev_had_reasoning=_had_reasoning(lane.resp), client=client, raw=raw,
                        shadow=shadow, res=res, shadow_res=shadow_res)

    def detect(self, prepared: Prepared) -> None:
        """Report this request against the lane's previous one; then it becomes the previous."""
        lane = self.store.get(prepared.lane)
        if lane is None or lane.turn != prepared.turn or prepared.res is None:
            return
        try:
            report = self._report(lane, prepared)
        except Exception:
            log.warning("prefix report failed for lane %s", lane.id, exc_info=True)
            report = None
        prepared.report = report
        prepared.header = header(report) if report else None
        lane.raw, lane.fwd, lane.shadow = prepared.raw, prepared.segments, prepared.shadow
        lane.fwd_body, lane.fwd_tokens = prepared.body, None
        lane.resp, lane.prompt_tokens = None, None
        if report is not None:
            lane.history.append(report)
        self.store.set_bytes(lane, state_bytes(lane))
        M.LANES.set(len(self.store))
        M.LANE_BYTES.set(self.store.nbytes)

    def _report(self, lane: LaneState, p: Prepared) -> PrefixReport:
        res, shadow_res = p.res, p.shadow_res
        assert res is not None
        sent = diff(lane.fwd, p.segments, lane.resp, lane.ratio)
        same_views = p.segments is p.raw and lane.fwd is lane.raw
        d = sent if same_views else diff(lane.raw, p.raw, lane.resp, lane.ratio)
        r = PrefixReport(lane.id, lane.turn, p.client, d.verdict, d.region, d.path,
                         d.char_offset, causes=d.causes, moved_from=d.moved_from,
                         moved_to=d.moved_to, tools_added=d.tools_added,
                         tools_removed=d.tools_removed, sent_verdict=sent.verdict)
        excerpts = self.settings.prefix_excerpts
        r.spans = [span_report(s.path, s.char_offset, s.old, s.new, s.causes, excerpts)
                   for s in d.spans]
        self._quantify(r, sent, d, lane)
        r.fixed = list(res.applied)
        r.saved_tokens = max(0, r.reusable_tokens - self._reusable(d, lane))
        if shadow_res is not None and shadow_res.changed and lane.shadow is not None:
            sd = diff(lane.shadow, p.shadow, lane.resp, lane.ratio)
            gain = max(0, self._reusable(sd, lane) - r.reusable_tokens)
            rules = [x for x in shadow_res.applied if x in self.hinted]
            if gain > 0:
                r.would_fix = [{"rule": x, "mode": self.modes[x], "saved_tokens": gain}
                               for x in rules]
        r.hint = hint_for(r.causes)
        return r

    def _prev_tokens(self, d: Diff, lane: LaneState) -> int:
        if lane.prompt_tokens:
            return lane.prompt_tokens
        return round(d.prev_chars / lane.ratio)

    def _reusable(self, d: Diff, lane: LaneState) -> int:
        prev = self._prev_tokens(d, lane)
        if d.verdict in REUSING or d.verdict is Verdict.NEW:
            return prev
        return min(prev, round(d.reusable_chars / lane.ratio))

    def _quantify(self, r: PrefixReport, sent: Diff, client: Diff, lane: LaneState) -> None:
        """Tokens the backend can reuse (from what was sent) and where the client broke the
        prefix (from what the client sent)."""
        if client.verdict is Verdict.NEW:
            return
        r.prev_prompt_tokens = self._prev_tokens(sent, lane)
        r.reusable_tokens = self._reusable(sent, lane)
        r.lost_tokens = r.prev_prompt_tokens - r.reusable_tokens
        if sent.verdict is Verdict.APPEND_ECHO_DRIFT:
            r.lost_tokens += round(sent.echo_lost_chars / lane.ratio)
        if r.path:
            r.token_offset = (self._reusable(client, lane) if client.verdict not in REUSING
                              else r.prev_prompt_tokens)

    # --- exact token offsets ----------------------------------------------------------------
    async def measure(self, prepared: Prepared, tokenize: Tokenize | None) -> None:
        """Replace estimates by exact counts: the token LCP of the lane's previous forwarded
        body and this one, both rendered by the backend. Only when what is sent diverges
        (an append reuses the whole previous prompt, whose count the backend reported). The
        previous turn's tokens are kept with the lane, so a run of mutated turns tokenizes
        each prompt once."""
        r = prepared.report
        if (tokenize is None or r is None or not r.sent_mutated
                or prepared.prev_body is None or r.region in ("model", "params")):
            return                     # a model change is not a prompt the tokenizer can show
        if prepared.prev_tokens is not None:
            prev, cur = prepared.prev_tokens, await tokenize(prepared.body)
        else:
            prev, cur = await asyncio.gather(tokenize(prepared.prev_body),
                                             tokenize(prepared.body))
        if not prev or cur is None:
            return
        n = min(len(prev), len(cur))
        lcp = next((i for i in range(n) if prev[i] != cur[i]), n)
        r.prev_prompt_tokens, r.reusable_tokens = len(prev), lcp
        r.lost_tokens = len(prev) - lcp
        if not r.fixed:                  # the client's break is the backend's break
            r.token_offset, r.token_offset_exact = lcp, True
        prepared.header = header(r)
        lane = self.store.get(prepared.lane)
        if lane is not None and lane.turn == prepared.turn:
            lane.fwd_tokens = cur

    # --- after the answer -------------------------------------------------------------------
    def record_response(self, prepared: Prepared, message: dict | None,
                        usage: dict | None) -> None:
        usage = usage or {}
        prompt = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        lane = self.store.get(prepared.lane) if prepared.turn else None
        if lane is not None and lane.turn == prepared.turn:
            ok = isinstance(prompt, int) and not isinstance(prompt, bool) and prompt > 0
            lane.resp, lane.prompt_tokens = message, prompt if ok else None
            self._learn_ratio(lane, prepared.segments, prompt)
        r = prepared.report
        if r is None:
            return
        if isinstance(usage.get("prefixd"), dict):
            r.backend_breakdown = usage["prefixd"]
        if isinstance(cached, int):
            self._reconcile(r, cached, prompt, prepared.prev_had_reasoning)
        observe(r)

    def _learn_ratio(self, lane: LaneState, segs: list[Segment], prompt: object) -> None:
        if not isinstance(prompt, int) or prompt <= 0:
            return
        chars = rendered_chars(segs)
        if chars <= 0:
            return
        seen = min(8.0, max(0.5, chars / prompt))
        lane.ratio = seen if not lane.ratio_learned else 0.7 * lane.ratio + 0.3 * seen
        lane.ratio_learned = True
        self.ratio = 0.9 * self.ratio + 0.1 * seen

    def _reconcile(self, r: PrefixReport, cached: int, prompt: object,
                   prev_had_reasoning: bool) -> None:
        r.backend_cached_tokens = cached
        r.backend_prompt_tokens = prompt if isinstance(prompt, int) else None
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

    # --- debug endpoints --------------------------------------------------------------------
    def debug_lanes(self) -> list[dict]:
        now = self.clock()
        return [{"lane": lane.id, "turn": lane.turn, "idle_s": round(now - lane.last_seen, 3),
                 "last_verdict": lane.history[-1].verdict.value if lane.history else None,
                 "prompt_tokens": lane.prompt_tokens, "chars_per_token": round(lane.ratio, 3),
                 "ratio_learned": lane.ratio_learned, "bytes": lane.nbytes,
                 "reports": len(lane.history)} for lane in self.store.lanes()]

    def debug_lane(self, lane: str) -> list[dict] | None:
        state = self.store.get(lane)
        if state is None:
            return None
        return [r.as_dict() for r in state.history]


def _had_reasoning(resp: dict | None) -> bool:
    if not resp:
        return False
    content = resp.get("content")
    return bool(resp.get("reasoning_content") or resp.get("reasoning")
                or (isinstance(content, str) and THINK.search(content)))
