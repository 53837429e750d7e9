"""The prefix tracker: the service the proxy's prefix stages (`proxy/stages/prefix.py`) call.
It resolves a request's lane and canonicalizes it (`canonicalize`), reports it against the
lane's previous request (`detect`), refines the report's token offsets (`measure`), makes it
the lane's newest turn once a backend accepted it (`commit`) and reconciles it with the
backend's `cached_tokens` (`record_response`).

Only a request a backend accepted (answered 200) is a turn: one refused before that (the
window, the queue, the backend's own 4xx) changes nothing of its lane but a refusal count, so
the next request is compared with the last one served.

Owns the `LaneStore` and each request's scratch between those calls (`compare.Turn`, kept
in `Prepared._turn`); the pipeline reads only `Prepared`'s public fields. The proxy owns I/O and the
event loop, and builds the `X-Prefixd-Prefix` header from `Prepared.report`
(`report.header`) when it sends its headers.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from prefixd.api.usage import Usage
from prefixd.metrics import prefix as M
from prefixd.proxy.keys import lane_scope
from prefixd.proxy.prefix import canonicalize as C
from prefixd.proxy.prefix.compare import Turn, compare, reconcile
from prefixd.proxy.prefix.lanes import (
    LaneState,
    LaneStore,
    base_key,
    shape,
    state_bytes,
    tool_set,
)
from prefixd.proxy.prefix.observe import observe
from prefixd.proxy.prefix.patterns import THINK, client_family
from prefixd.proxy.prefix.report import PrefixReport
from prefixd.proxy.prefix.segments import Segment, flatten, rendered_chars
from prefixd.proxy.settings import Settings

log = logging.getLogger("prefixd.prefix")

Tokenize = Callable[[dict], Awaitable[list[int] | None]]


@dataclass(slots=True)
class Prepared:
    """One request as the prefix stages leave it: its lane, the body to forward (`changed`:
    not the client's), the forwarded segments in render order (routing reads them) and, once
    detected, its report."""

    lane: str
    body: dict
    changed: bool
    segments: list[Segment] = field(default_factory=list)
    report: PrefixReport | None = None
    _turn: Turn | None = field(default=None, repr=False)     # the tracker's scratch
    served: bool = False                                     # committed as its lane's turn


class PrefixTracker:
    """Lanes, canonicalization and mutation reports over one `LaneStore`.

    `canonicalize()` runs on every request (the rules that are on); `detect()` and `measure()`
    only when prefix detection is on; `record_response()` after a complete answer."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        secret = (settings.lane_secret.get_secret_value().encode() if settings.lane_secret
                  else secrets.token_bytes(32))          # random per run unless configured
        self.store = LaneStore(settings.lane_idle_s, settings.lane_max, settings.lane_max_bytes,
                               settings.prefix_history, secret)
        self.ratio = 4.0            # chars per token, learned across lanes for new ones
        self.modes = settings.rule_modes()
        self.live = frozenset(r for r, m in self.modes.items() if m == "on")
        # Rules that are not on still run on a shadow copy, so a report can say what they
        # would keep (`would_fix`); dry_run rules are also counted in the metrics.
        self.hinted = {r: m for r, m in self.modes.items() if r not in self.live}

    # --- before forwarding ------------------------------------------------------------------
    def canonicalize(self, body: dict, headers: Mapping[str, str],
                     namespace: str = "") -> Prepared:
        """The lane and the body to forward. Never raises: a body this step cannot read is
        forwarded untouched. `namespace`: the request's cache partition (per-key isolation):
        lanes of other partitions are never its lane."""
        try:
            return self._canonicalize(body, headers, namespace)
        except Exception:
            log.warning("prefix stage skipped a request it could not read", exc_info=True)
            return Prepared("-", body, False)

    def _canonicalize(self, body: dict, headers: Mapping[str, str],
                      namespace: str) -> Prepared:
        client = client_family(headers)
        raw = flatten(body)
        session = base_key(headers, body, raw, client, self.store.secret, namespace)
        lane = self.store.resolve(lane_scope(namespace) + session, shape(body, raw),
                                  self.clock())
        if lane.turn == 0:
            lane.ratio = self.ratio
        res = C.canonicalize(body, lane.canon, self.live)
        shadow_res, shadow = None, None
        if self.settings.prefix_detect and self.hinted:
            shadow_res = C.canonicalize(body, lane.canon, self.live | frozenset(self.hinted),
                                        shadow=True)
            shadow = flatten(shadow_res.body) if shadow_res.changed else raw
        turn = Turn(lane.turn + 1, client, body, raw, shadow, res, shadow_res, lane.fwd_body,
                    lane.fwd_tokens, _had_reasoning(lane.resp))
        return Prepared(lane.id, res.body, res.changed, flatten(res.body) if res.changed else raw,
                        _turn=turn)

    def detect(self, prepared: Prepared) -> None:
        """Report this request against the lane's last served one (the lane is not changed:
        `commit` does that once a backend accepts the request)."""
        lane, t = self._pending(prepared), prepared._turn
        if lane is None or t is None:
            return
        try:
            report: PrefixReport | None = compare(lane, t, prepared.segments, self.hinted,
                                                  self.settings.prefix_excerpts)
        except Exception:
            log.warning("prefix report failed for lane %s", lane.id, exc_info=True)
            report = None
        if report is not None:
            report.turn = t.number
        prepared.report = report

    def commit(self, prepared: Prepared) -> None:
        """A backend accepted the request: it becomes its lane's newest turn (what the next
        request is compared with, what canonicalization learned, its report in the lane's
        history). Once per request, however many attempts it took."""
        t = prepared._turn
        if prepared.served or t is None:
            return
        prepared.served = True
        lane = self.store.get(prepared.lane)
        if lane is None:
            return                       # expired or evicted meanwhile
        C.commit(lane.canon, t.body, t.res)
        if t.shadow_res is not None:
            C.commit(lane.canon, t.body, t.shadow_res, shadow=True)
        lane.turn += 1
        t.number = lane.turn
        lane.tools = tool_set(t.body)
        lane.raw, lane.fwd, lane.shadow = t.raw, prepared.segments, t.shadow
        lane.fwd_body, lane.fwd_tokens = prepared.body, t.tokens
        lane.resp, lane.prompt_tokens = None, None
        if prepared.report is not None:
            prepared.report.turn = t.number
            lane.history.append(prepared.report)
        self.store.set_bytes(lane, state_bytes(lane))
        M.LANES.set(len(self.store))
        M.LANE_BYTES.set(self.store.nbytes)

    def unserved(self, prepared: Prepared) -> None:
        """The request ended without a backend accepting it (refused, or its client left while
        it waited): its lane only counts it."""
        lane = self._pending(prepared)
        if lane is not None and not prepared.served:
            lane.unserved += 1

    def _pending(self, prepared: Prepared) -> LaneState | None:
        """The lane of a request not committed yet."""
        return self.store.get(prepared.lane) if prepared._turn is not None else None

    def _lane(self, prepared: Prepared) -> LaneState | None:
        """The request's lane, if the request is its newest served turn."""
        t = prepared._turn
        lane = self.store.get(prepared.lane) if t is not None and prepared.served else None
        return lane if lane is not None and t is not None and lane.turn == t.number else None

    # --- exact token offsets ----------------------------------------------------------------
    async def measure(self, prepared: Prepared, tokenize: Tokenize | None) -> None:
        """Replace estimates by exact counts: the token LCP of the lane's previous forwarded
        body and this one, both rendered by the backend. Only when what is sent diverges
        (an append reuses the whole previous prompt, whose count the backend reported). The
        previous turn's tokens are kept with the lane, so a run of mutated turns tokenizes
        each prompt once."""
        r, t = prepared.report, prepared._turn
        if (tokenize is None or r is None or t is None or not r.sent_mutated
                or t.prev_body is None or r.region in ("model", "params")):
            return                     # a model change is not a prompt the tokenizer can show
        prev: list[int] | None
        if t.prev_tokens is not None:
            prev, cur = t.prev_tokens, await tokenize(prepared.body)
        else:
            prev, cur = await asyncio.gather(tokenize(t.prev_body), tokenize(prepared.body))
        if not prev or cur is None:
            return
        t.tokens = cur                   # the lane's `fwd_tokens` once it is served
        n = min(len(prev), len(cur))
        lcp = next((i for i in range(n) if prev[i] != cur[i]), n)
        r.prev_prompt_tokens, r.reusable_tokens = len(prev), lcp
        r.lost_tokens = len(prev) - lcp
        if not r.fixed:                  # the client's break is the backend's break
            r.token_offset, r.token_offset_exact = lcp, True

    # --- after the answer -------------------------------------------------------------------
    def record_response(self, prepared: Prepared, message: dict | None,
                        usage: Usage | None) -> None:
        """The answer to this request: the lane keeps it (echo drift, the next turn's
        reasoning suspect) with its prompt count, and the report is reconciled with what the
        backend says it reused, then logged and counted. An answer means a backend accepted
        the request: it is committed first if nothing did yet (`commit`)."""
        self.commit(prepared)
        prompt = usage.prompt if usage is not None else None
        lane = self._lane(prepared)
        if lane is not None:
            lane.resp, lane.prompt_tokens = message, prompt or None
            if prompt:
                self._learn_ratio(lane, prepared.segments, prompt)
        r, t = prepared.report, prepared._turn
        if r is None or t is None:
            return
        if usage is not None and usage.worker is not None:
            r.backend_breakdown = dict(usage.worker)
        if usage is not None and usage.cached is not None:
            reconcile(r, usage.cached, usage.prompt, t.prev_had_reasoning)
        observe(r)

    def _learn_ratio(self, lane: LaneState, segs: list[Segment], prompt: int) -> None:
        chars = rendered_chars(segs)
        if chars <= 0:
            return
        seen = min(8.0, max(0.5, chars / prompt))
        lane.ratio = seen if not lane.ratio_learned else 0.7 * lane.ratio + 0.3 * seen
        lane.ratio_learned = True
        self.ratio = 0.9 * self.ratio + 0.1 * seen

    # --- debug endpoints --------------------------------------------------------------------
    def debug_lanes(self, sees: Callable[[str], bool] = lambda lane: True) -> list[dict]:
        """The lanes `sees` lets the caller see (`keys.Viewer.sees`: under per-key isolation,
        only its own key's), with their counters."""
        now = self.clock()
        return [{"lane": lane.id, "turn": lane.turn, "idle_s": round(now - lane.last_seen, 3),
                 "last_verdict": lane.history[-1].verdict.value if lane.history else None,
                 "prompt_tokens": lane.prompt_tokens, "chars_per_token": round(lane.ratio, 3),
                 "ratio_learned": lane.ratio_learned, "bytes": lane.nbytes,
                 "reports": len(lane.history), "unserved": lane.unserved}
                for lane in self.store.lanes() if sees(lane.id)]

    def debug_lane(self, lane: str, sees: Callable[[str], bool] = lambda lane: True
                   ) -> list[dict] | None:
        """A lane's reports, or None when there is no such lane the caller may see (another
        key's lane is answered as one that does not exist)."""
        state = self.store.get(lane) if sees(lane) else None
        if state is None:
            return None
        return [r.as_dict() for r in state.history]


def _had_reasoning(resp: dict | None) -> bool:
    if not resp:
        return False
    content = resp.get("content")
    return bool(resp.get("reasoning_content") or resp.get("reasoning")
                or (isinstance(content, str) and THINK.search(content)))
