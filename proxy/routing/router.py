"""The router the proxy owns: which backend serves a request, and everything routing knows.

Owns, for every backend: the prefix index (`index.py`: which prompt prefixes it holds) and its
predicted-vs-reported accounting (`truth`), conversation affinity, the requests it is computing
now (`inflight.py`), transfer planning between prefixd workers, the llama-server slot planners
(`slots.py`), and what `/status` shows of all that. The decision itself is pure policy
(`policy.py`) over plain data.

A request gets one `RouteView` (its model, lane, prefix chain, and what each backend holds of
it: the index is read once per request); each attempt at serving it (`proxy/attempt.py`) gets a
`Decision` from that view. After a complete answer, what the backend reported corrects the
index (`learn`). A backend whose cache was lost (restarted, went down, refused a request) is
forgotten.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

from prefixd.api.errors import ApiError
from prefixd.api.usage import Usage
from prefixd.backends.base import Backend, BackendUnavailable
from prefixd.metrics import proxy as m
from prefixd.proxy.attempt import Attempt, TransferPlan
from prefixd.proxy.queue import BackendQueue
from prefixd.proxy.routing.index import Chain, PrefixIndex, Restorable
from prefixd.proxy.routing.inflight import InFlight
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
    transfer_source,
)
from prefixd.proxy.routing.slots import SlotPlanner
from prefixd.proxy.settings import Settings

MISPREDICT_SLACK = 16     # tokens: templates re-render the last turn's tail
TRUTH = ("predicted_tokens", "reported_tokens", "mispredictions",     # per backend, for /status
         "transferred_tokens")
WAIT_MIN_TOKENS = 256     # a shared prefix worth waiting for when transfers are off


@dataclass(frozen=True)
class RouteView:
    """What routing knows of one request, computed once: its served model, its conversation
    (lane), its prefix chain, and backend -> (tokens of that chain it holds, whether that
    reaches past the chain's head)."""

    model: str
    lane: str | None
    chain: Chain
    held: dict[str, tuple[int, bool]]


class Router:
    def __init__(self, backends: dict[str, Backend], queues: dict[str, BackendQueue],
                 settings: Settings) -> None:
        self.backends, self.queues = backends, queues
        self.index = models_index({n: b.models for n, b in backends.items()})
        self.aliases = settings.model_aliases
        self.balance = Balance(settings.route_balance_slack, settings.route_balance_ratio,
                               settings.route_min_hit_tokens)
        self.affinity = AffinityMap()
        self.prefixes = PrefixIndex(settings.route_index_entries, settings.route_index_ttl_s)
        self.transfer_min_tokens = settings.route_transfer_min_tokens
        self.prefix_wait_s = settings.route_prefix_wait_s
        self.inflight = InFlight()                  # what each backend is computing now
        self._seen: dict[str, tuple[int, bool]] = {}     # backend -> (generation, up)
        self._planners: dict[str, SlotPlanner] = {}      # llama-servers with slots
        self._incompatible: set[tuple[str, str]] = set()   # (source, target): other models
        # model -> its tokens per estimated token (its tokenizer against 4 chars a token),
        # from the last prompt a backend reported: puts prefixes in flight on the index's scale
        self._scale: dict[str, float] = {}
        # backend -> predicted / reported cached tokens and mispredictions, for /status
        self.truth: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        # benchmarks swap in other policies (bench/routing.py)
        self.policy: Policy = functools.partial(decide, policy=self.balance)

    # --- a request's view, and each attempt's decision ----------------------------------------
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

    def view(self, model: str, lane: str | None, chain: Chain) -> RouteView:
        for name in self.index[model]:
            self._check_generation(name)
        held = self.prefixes.longest(chain, time.monotonic()) if chain.bounds else {}
        view = RouteView(model, lane, chain, held)
        if held:
            # no backend holds more of a prompt than the prompt: entries recorded for an
            # earlier render (a reply re-rendered shorter, a stored reply's own tokens) are
            # capped at this request's size
            size = self.prompt_size(view) or 0
            view = RouteView(model, lane, chain,
                             {n: (min(t, size), own) for n, (t, own) in held.items()})
        return view

    def prompt_size(self, view: RouteView) -> int | None:
        """The request's prompt tokens as estimated from its rendered size, on the model's
        scale (its tokens per estimated token, learned from the backends' reports)."""
        if not view.chain.bounds:
            return None
        return round(view.chain.bounds[-1].tokens * self._scale.get(view.model, 1.0))

    def decide(self, view: RouteView, exclude: list[str] | tuple[str, ...] = ()) -> Decision:
        """The backend for the next attempt (`exclude`: those that refused it already)."""
        cands = []
        for n in self.index[view.model]:
            if n in exclude:
                continue
            q = self.queues[n]
            tokens, own = view.held.get(n, (0, False))
            cands.append(Candidate(n, self.backends[n].status().available,
                                   q.waiting + q.in_flight, q.max_concurrency,
                                   tokens if own else 0, tokens))
        decision = self.policy(cands, self.affinity.get(view.lane),
                               view.chain.key or str(view.lane))
        if exclude:                       # sent again: the chosen backend refused it
            decision = dataclasses.replace(decision, reason="failover")
        self.affinity.set(view.lane, decision.name)
        m.ROUTE_DECISIONS.labels(decision.name, decision.reason).inc()
        m.ROUTE_PREDICTED_TOKENS.labels(decision.name).inc(decision.predicted)
        return decision

    def tokenizer_for(self, model: str) -> Backend:
        """A backend of `model` to count tokens with (count_tokens): not a routing decision,
        so nothing is counted or remembered; the first one that is up."""
        names = self.index[model]
        return self.backends[next((n for n in names if self.backends[n].status().up),
                                  names[0])]

    async def restarted(self, name: str) -> bool:
        """Whether `name` restarts itself (a managed worker) and is ready again now."""
        backend = self.backends[name]
        if not backend.capabilities.restarts_itself:
            return False
        try:
            await backend.ensure_ready()
        except BackendUnavailable:
            return False
        return True

    # --- transfers and the prefix wait ----------------------------------------------------------
    def transfer_plan(self, view: RouteView, target: str) -> TransferPlan | None:
        """The copy to make when another worker of the model holds or is computing at least
        `transfer_min_tokens` more of this request's prefix than `target` (both must move
        state: prefixd workers); None otherwise."""
        if not self.transfer_min_tokens or not view.chain.bounds or \
                not self.backends[target].capabilities.moves_state:
            return None
        have, computing = {}, {}
        for n in self.index[view.model]:
            b = self.backends[n]
            if n == target or (b.capabilities.moves_state and b.status().up
                               and (n, target) not in self._incompatible):
                held = view.held.get(n, (0, False))[0]
                tokens, done = self._computing(view, n)
                have[n] = max(held, tokens)
                if tokens > held:
                    computing[n] = done
        plan = transfer_source(target, have, self.transfer_min_tokens)
        return None if plan is None else TransferPlan(*plan, computing.get(plan[0]))

    def transferred(self, source: str, target: str, tokens: int,
                    incompatible: bool = False) -> None:
        """What a planned transfer did (the transfer stage reports it)."""
        if incompatible:
            self._incompatible.add((source, target))
        if tokens:
            self.truth[target]["transferred_tokens"] += tokens

    def _computing(self, view: RouteView, name: str) -> tuple[int, asyncio.Event | None]:
        """(tokens of the request's prefix that a request `name` is computing shares, on the
        index's scale: the model's tokens per estimated token; that request's end event)."""
        tokens, done = self.inflight.computing(name, view.chain)
        return round(tokens * self._scale.get(view.model, 1.0)), done

    async def wait_for_prefix(self, view: RouteView, name: str) -> bool:
        """A llama-server running several requests at once (its slots) computing a long
        prefix of this request that it does not hold yet: wait (at most `prefix_wait_s`) until
        that request ends, so this one restores the prefix from the backend's cache instead of
        computing it again beside it (slots share no KV). True if it
        waited (what the backends hold has changed since `view`)."""
        backend = self.backends[name]
        # a prefixd worker does this itself, for every request it holds, arrived together or
        # not (`scheduler/schedule.py`: `share`), and only until the prefix is computed
        if not self.prefix_wait_s or self.queues[name].max_concurrency <= 1 or \
                backend.slot_info() is None:
            return False
        tokens, done = self._computing(view, name)
        held = view.held.get(name, (0, False))[0]
        if done is None or tokens - held < (self.transfer_min_tokens or WAIT_MIN_TOKENS):
            return False
        try:
            async with asyncio.timeout(self.prefix_wait_s):
                await done.wait()
            outcome = "done"
        except TimeoutError:
            outcome = "timeout"
        m.PREFIX_WAITS.labels(name, outcome).inc()
        return True

    # --- an attempt from start to end -----------------------------------------------------------
    async def begin(self, view: RouteView, attempt: Attempt, request_id: str) -> None:
        """The attempt is about to run: it is computing its chain there from its queue slot
        on, and a llama-server's planner expects it."""
        name = attempt.backend.name
        self.inflight.add(name, attempt, view.chain)
        planner = self.planner(name)
        if planner is not None and view.lane:
            attempt.placement = planner.expect(request_id, view.lane, attempt.decision.predicted)
            await planner.occupy()

    def pin(self, attempt: Attempt, raw: bytes) -> bytes:
        """The bytes to send for the attempt: with a slot pin (or marker) where that helps."""
        planner = self._planners.get(attempt.backend.name)
        if planner is None or attempt.placement is None:
            return raw
        return planner.prepare(attempt.placement.request_id, raw)

    async def end(self, attempt: Attempt) -> None:
        """The attempt ended (answered, failed, or sent elsewhere); a complete answer teaches
        the slot planner where it ran."""
        name = attempt.backend.name
        planner, placed = self._planners.get(name), attempt.placement
        try:
            if planner is not None and placed is not None and attempt.completed:
                await planner.learn(placed, attempt.usage)
        finally:
            self.inflight.remove(name, attempt)
            if planner is not None and placed is not None:
                planner.done(placed)

    def planner(self, name: str) -> SlotPlanner | None:
        """The planner of a backend that reports slots, made anew each time it came up."""
        backend = self.backends[name]
        info = backend.slot_info()
        planner = self._planners.get(name)
        if info is None:
            self._planners.pop(name, None)
            return None
        if planner is None or planner.info is not info:
            planner = self._planners[name] = SlotPlanner(backend, info)
        return planner

    # --- what the answer taught ---------------------------------------------------------------
    def learn(self, view: RouteView, attempt: Attempt) -> None:
        """The backend now holds this prompt; what it reported corrects the prediction."""
        chain, decision, usage = view.chain, attempt.decision, attempt.usage or Usage()
        if not chain.bounds:
            return
        predicted = max(decision.predicted, attempt.transferred)
        truth = self.truth[decision.name]
        truth["predicted_tokens"] += predicted
        truth["reported_tokens"] += usage.cached or 0
        if usage.cached is not None and usage.cached + MISPREDICT_SLACK < predicted:
            m.ROUTE_MISPREDICTIONS.labels(decision.name).inc()
            truth["mispredictions"] += 1
            self.prefixes.forget(decision.name, chain, after_tokens=usage.cached)
        now = time.monotonic()
        if usage.prompt and chain.bounds[-1].tokens > 0:
            self._scale[view.model] = usage.prompt / chain.bounds[-1].tokens
        self.prefixes.record(decision.name, chain, now, usage.prompt or None,
                             Restorable.from_digest(usage.worker), MISPREDICT_SLACK)
        if view.lane:
            self.prefixes.note(decision.name, view.lane,
                               usage.prompt or chain.bounds[-1].tokens, now)
        m.INDEX_ENTRIES.labels(decision.name).set(self.prefixes.size(decision.name))

    def _check_generation(self, name: str) -> None:
        """A backend that restarted or went down lost its cache: forget its entries."""
        st = self.backends[name].status()
        seen = (st.generation, st.up)
        old = self._seen.get(name)
        if old is not None and old != seen and (not st.up or seen[0] != old[0]):
            self.forget(name)
        self._seen[name] = seen

    def forget(self, name: str) -> None:
        """`name` lost its cache (restarted, went down, refused a request)."""
        self.prefixes.forget(name)
        self._incompatible = {p for p in self._incompatible if name not in p}
        m.INDEX_ENTRIES.labels(name).set(0)

    def status(self, name: str, sees: Callable[[str], bool] = lambda lane: True) -> dict:
        """What /status shows of routing for a backend: its index (entries, the conversations
        `sees` lets the caller see and their tokens, the largest first), how its reported
        cached tokens met the predictions, and a llama-server's slots."""
        planner = self.planner(name)
        return {"index_entries": self.prefixes.size(name),
                "index": {**self.prefixes.summary(name, time.monotonic(), sees=sees),
                          **{k: self.truth[name][k] for k in TRUTH}},
                **(planner.status() if planner is not None else {})}

