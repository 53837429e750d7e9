"""The routing core: which endpoint serves a request, decided on snapshots. `prefixd serve`'s
router (`router.py`) and the gateway's endpoint picker (`proxy/picker`) both run it.

Owns: the endpoints as last told (`Endpoint` snapshots; they join, leave and change at run
time: `update`), the model index over them, the prefix index (`index.py`: which prompt
prefixes each endpoint holds) and its predicted-vs-reported accounting (`truth`),
conversation affinity, and each model's tokens per estimated token. No I/O, no queue, no
attempt: a caller hands it snapshots and requests (`view`, `ranked`), and feeds back what
each endpoint reported, or that it lost its cache, through one call (`outcome`). The
decision itself is pure policy (`policy.py`).

An endpoint whose cache was lost (a new `generation`, or it went down) is forgotten: its
index entries, and its affinity stays only as a hint that load balancing overrides.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Self

from prefixd.api.errors import ApiError
from prefixd.metrics import kvevents as km
from prefixd.metrics import proxy as m
from prefixd.proxy.routing.follow import Follow
from prefixd.proxy.routing.index import Chain, PrefixIndex, Restorable
from prefixd.proxy.routing.policy import (
    AffinityMap,
    Balance,
    Candidate,
    Decision,
    Policy,
    alias_for,
    decide,
    models_index,
    resolve_model,
)

if TYPE_CHECKING:
    from prefixd.proxy.settings import Settings

MISPREDICT_SLACK = 16     # tokens: templates re-render the last turn's tail
TRUTH = ("predicted_tokens", "reported_tokens", "mispredictions",     # per endpoint, for /status
         "transferred_tokens", "event_mispredictions")


@dataclass(frozen=True)
class Endpoint:
    """What routing is told of one endpoint (a backend of `prefixd serve`, a model server
    behind a gateway), as of now."""

    name: str
    models: tuple[str, ...]
    up: bool = True              # takes requests (a stopped managed worker would start)
    load: int = 0                # requests waiting + in flight there
    max_concurrency: int = 1
    generation: int = 0          # changes whenever its prompt cache was lost (restarted)
    alive: bool = True           # its process (and cache) is up now
    address: str = ""            # ip:port a gateway sends to


@dataclass(frozen=True)
class RouteView:
    """What routing knows of one request, computed once: its served model, its conversation
    (lane), its prefix chain, and endpoint -> (tokens of that chain it holds, whether that
    reaches past the chain's head)."""

    model: str
    lane: str | None
    chain: Chain
    held: dict[str, tuple[int, bool]]
    via_events: frozenset[str] = frozenset()   # whose `held` its KV events gave


@dataclass(frozen=True)
class Reported:
    """What an endpoint reported of a request it answered in full: its prompt tokens, the
    cached ones, a prefixd worker's digest of what it can restore (its answer's `prefixd`
    object, beside `usage`)."""

    prompt: int | None = None
    cached: int | None = None
    worker: Mapping[str, Any] | None = None


def core_args(settings: Settings) -> tuple[Balance, dict[str, str], int, float]:
    """`RoutingCore`'s arguments from the settings (`PREFIXD_ROUTE_*`, model aliases)."""
    return (Balance(settings.route_balance_slack, settings.route_balance_ratio,
                    settings.route_min_hit_tokens), settings.model_aliases,
            settings.route_index_entries, settings.route_index_ttl_s)


class RoutingCore:
    def __init__(self, balance: Balance, aliases: dict[str, str] | None = None,
                 index_entries: int = 100_000, index_ttl_s: float = 7200.0) -> None:
        self.aliases = dict(aliases or {})
        self.balance = balance
        self.endpoints: dict[str, Endpoint] = {}
        self.index: dict[str, list[str]] = {}       # model -> its endpoints, in order
        self.affinity = AffinityMap()
        self.prefixes = PrefixIndex(index_entries, index_ttl_s)
        self.follow = Follow()                      # what endpoints announce (KV events)
        # model -> its tokens per estimated token (its tokenizer against 4 chars a token),
        # from the last prompt an endpoint reported: puts estimates on the index's scale
        self._scale: dict[str, float] = {}
        self.truth: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        # benchmarks swap in other policies (bench/routing.py)
        self.policy: Policy = lambda cands, lane, key: decide(cands, lane, key, self.balance)

    @classmethod
    def from_settings(cls, settings: Settings) -> Self:
        return cls(*core_args(settings))

    # --- the endpoints --------------------------------------------------------------------------
    def update(self, endpoints: Iterable[Endpoint]) -> None:
        """The endpoints as they are now (the whole set): new ones join, missing ones leave
        (forgotten), one whose cache was lost (another generation, no longer alive) or that is
        another server now (another address) is forgotten."""
        now = {e.name: e for e in endpoints}
        for name, old in self.endpoints.items():
            new = now.get(name)
            if new is None or new.generation != old.generation or new.address != old.address \
                    or (old.alive and not new.alive):
                self.forget(name)
        if [e.models for e in now.values()] != [e.models for e in self.endpoints.values()] \
                or now.keys() != self.endpoints.keys():
            self.index = models_index({n: list(e.models) for n, e in now.items()})
        self.endpoints = now

    def forget(self, name: str) -> None:
        """`name` lost its cache (restarted, went down, refused a request, left)."""
        self.prefixes.forget(name)
        self.follow.lost(name)
        m.INDEX_ENTRIES.labels(name).set(0)

    # --- a request --------------------------------------------------------------------------
    def model_for(self, requested: str | None) -> str:
        """The served model for a request's `model`; 400/404 naming what is served."""
        model = resolve_model(requested, self.index, self.aliases)
        if model is not None:
            return model
        if requested is None:
            raise ApiError(400, "'model' is required: this proxy serves "
                           f"{sorted(self.index)}", param="model", code="missing_field")
        if (alias := alias_for(requested, self.aliases)) is not None:
            raise ApiError(404, f"model {requested!r} matches the alias {alias[0]!r}, whose "
                           f"target {alias[1]!r} is not served here; available: "
                           f"{sorted(self.index)}", param="model", code="model_not_found",
                           type_="invalid_request_error")
        raise ApiError(404, f"model {requested!r} is not served here; available: "
                       f"{sorted(self.index)} (PREFIXD_MODEL_ALIASES maps other names)",
                       param="model", code="model_not_found", type_="invalid_request_error")

    def view(self, model: str, lane: str | None, chain: Chain,
             tokens: Sequence[int] | None = None) -> RouteView:
        """What routing knows of a request. `tokens`: its prompt's token ids (the backends'
        tokenizer), which the endpoints' KV events are looked up by (`follow.py`)."""
        held = self.prefixes.longest(chain, time.monotonic()) if chain.bounds else {}
        view = RouteView(model, lane, chain, held)
        if held:
            # no endpoint holds more of a prompt than the prompt: entries recorded for an
            # earlier render (a reply re-rendered shorter, a stored reply's own tokens) are
            # capped at this request's size
            size = self.prompt_size(view) or 0
            view = RouteView(model, lane, chain,
                             {n: (min(t, size), own) for n, (t, own) in held.items()})
        if tokens:
            view = self._with_events(view, tokens)
        return view

    def wants_tokens(self, model: str) -> bool:
        """Whether a request for `model` is worth tokenizing before routing: an endpoint of
        it has a KV event stream that has been heard."""
        return self.follow.follows(self.index.get(model, ()))

    def _with_events(self, view: RouteView, tokens: Sequence[int]) -> RouteView:
        """`view` with what the endpoints' KV events say they hold of `tokens`: a complete
        feed's word replaces what answers taught, a partial one's only adds to it. A prefix
        past the middle of the conversation's first user message (as estimated) is the
        conversation's own: a new one sharing only the system prompt stops near its start.
        The estimates are scaled to the prompt's exact size."""
        credit = self.follow.credit(self.index.get(view.model, ()), tokens)
        if not credit:
            return view
        bounds, head = view.chain.bounds, view.chain.head
        # the estimates put on the prompt's exact size (its token ids are here)
        scale = len(tokens) / bounds[-1].tokens if bounds and bounds[-1].tokens else 1.0
        hi = bounds[head - 1].tokens * scale if head else 0.0
        lo = bounds[head - 2].tokens * scale if head >= 2 else 0.0
        held, via = dict(view.held), set()
        for name, (t, complete) in credit.items():
            before = held.get(name, (0, False))
            if complete or t > before[0]:
                held[name] = (t, t > (lo + hi) / 2)
                via.add(name)
        return replace(view, held=held, via_events=frozenset(via))

    def prompt_size(self, view: RouteView) -> int | None:
        """The request's prompt tokens as estimated from its rendered size, on the model's
        scale (its tokens per estimated token, learned from the endpoints' reports)."""
        if not view.chain.bounds:
            return None
        return round(view.chain.bounds[-1].tokens * self._scale.get(view.model, 1.0))

    def ranked(self, view: RouteView, exclude: Collection[str] = (),
               among: Collection[str] | None = None) -> list[Decision]:
        """The endpoints of the request's model in the order to try them (`exclude`: those
        that refused it already; `among`: only these, e.g. a gateway's subset hint): the
        policy's choice first, then the others by the prefix they hold, then load. Empty when
        none is eligible. The first is remembered as the conversation's."""
        cands = [self._candidate(n, view) for n in self.index.get(view.model, ())
                 if n not in exclude and (among is None or n in among)]
        if not cands:
            return []
        first = self.policy(cands, self.affinity.get(view.lane), view.chain.key or
                            str(view.lane))
        if exclude:                       # sent again: the chosen endpoint refused it
            first = replace(first, reason="failover")
        self.affinity.set(view.lane, first.name)
        m.ROUTE_DECISIONS.labels(first.name, first.reason).inc()
        m.ROUTE_PREDICTED_TOKENS.labels(first.name).inc(first.predicted)
        rest = sorted((c for c in cands if c.name != first.name),
                      key=lambda c: (not c.up, -c.cached, -c.shared,
                                     c.load / max(1, c.max_concurrency)))
        return [first, *(Decision(c.name, "fallback", c.shared) for c in rest)]

    def _candidate(self, name: str, view: RouteView) -> Candidate:
        e = self.endpoints[name]
        tokens, own = view.held.get(name, (0, False))
        return Candidate(name, e.up, e.load, e.max_concurrency, tokens if own else 0, tokens)

    # --- what came back -----------------------------------------------------------------------
    def outcome(self, view: RouteView, decision: Decision, reported: Reported | None = None,
                transferred: int = 0, lost: bool = False) -> None:
        """What serving the request at `decision` gave: `lost`, the endpoint took nothing of
        it (refused, gone: its cache is forgotten); else, after a complete answer, what it
        reported (`reported`) corrects the prediction and the index, which now holds this
        prompt there."""
        if lost:
            self.forget(decision.name)
            return
        reported = reported or Reported()
        chain = view.chain
        if not chain.bounds:
            return
        predicted = max(decision.predicted, transferred)
        truth = self.truth[decision.name]
        truth["predicted_tokens"] += predicted
        truth["reported_tokens"] += reported.cached or 0
        if decision.name in view.via_events:      # exact: a token short is a miss
            km.CREDITED.labels(decision.name).inc(decision.predicted)
            if reported.cached is not None and reported.cached < decision.predicted:
                km.MISSES.labels(decision.name).inc()
                truth["event_mispredictions"] += 1
        if reported.cached is not None and reported.cached + MISPREDICT_SLACK < predicted:
            m.ROUTE_MISPREDICTIONS.labels(decision.name).inc()
            truth["mispredictions"] += 1
            self.prefixes.forget(decision.name, chain, after_tokens=reported.cached)
        now = time.monotonic()
        if reported.prompt and chain.bounds[-1].tokens > 0:
            self._scale[view.model] = reported.prompt / chain.bounds[-1].tokens
        self.prefixes.record(decision.name, chain, now, reported.prompt or None,
                             Restorable.from_digest(reported.worker), MISPREDICT_SLACK)
        if view.lane:
            self.prefixes.note(decision.name, view.lane,
                               reported.prompt or chain.bounds[-1].tokens, now)
        m.INDEX_ENTRIES.labels(decision.name).set(self.prefixes.size(decision.name))

    def index_status(self, name: str, sees: Callable[[str], bool] = lambda lane: True) -> dict:
        """What /status shows of an endpoint's index: its entries, the conversations `sees`
        lets the caller see and their tokens (the largest first), how its reported cached
        tokens met the predictions."""
        return {"index_entries": self.prefixes.size(name),
                "index": {**self.prefixes.summary(name, time.monotonic(), sees=sees),
                          **{k: self.truth[name][k] for k in TRUTH}},
                **({"kv_events": f} if (f := self.follow.status(name)) is not None else {})}
