"""route: the requested model → its backends → one of them. The decision is pure policy
(`proxy/route.py`) over what the prefix index (`proxy/index.py`) says each backend holds;
after the answer, the backend's reported usage corrects the index (backend truth), and a prefixd
worker's digest of what it can restore (`usage.prefixd.restorable`) says which prefixes it
really holds. On a llama-server, the request is announced to the backend's slot book
(`backends/llama.py`), which may pin it to a slot when it is sent, and told how it ended.
Between prefixd workers of one model, it plans a state transfer (`ex.transfer`, carried out by
the transfer stage once the request has its slot) when another worker holds or is computing a
much longer prefix of the request than the chosen one."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import time
from typing import Any

from prefixd.api.errors import ApiError
from prefixd.backends.base import Backend, BackendGone, BackendUnavailable
from prefixd.metrics import proxy as m
from prefixd.proxy.exchange import Exchange
from prefixd.proxy.index import Chain, PrefixIndex, Restorable, boundaries
from prefixd.proxy.inflight import InFlight
from prefixd.proxy.prefix.report import header
from prefixd.proxy.queue import BackendQueue
from prefixd.proxy.route import (
    AffinityMap,
    Balance,
    Candidate,
    Decision,
    Policy,
    decide,
    resolve_model,
    transfer_source,
)
from prefixd.proxy.stages import Next

MISPREDICT_SLACK = 16     # tokens: templates re-render the last turn's tail
TRUTH = ("predicted_tokens", "reported_tokens", "mispredictions",     # per backend, for /status
         "transferred_tokens")
WAIT_MIN_TOKENS = 256     # a shared prefix worth waiting for when transfers are off
MAX_DIGEST = 1024         # positions read of a backend's restorable digest (a worker sends 64)


class RouteStage:
    name = "route"

    def __init__(self, backends: dict[str, Backend], queues: dict[str, BackendQueue],
                 index: dict[str, list[str]], balance: Balance,
                 aliases: dict[str, str] | None = None,
                 prefixes: PrefixIndex | None = None, transfer_min_tokens: int = 0,
                 prefix_wait_s: float = 0.0) -> None:
        self.backends, self.queues, self.index = backends, queues, index
        self.aliases = aliases or {}
        self.balance = balance
        self.affinity = AffinityMap()
        self.prefixes = prefixes or PrefixIndex()
        self._epochs: dict[str, object] = {}
        self.transfer_min_tokens = transfer_min_tokens
        self.inflight = InFlight()                  # what each backend is computing now
        self.prefix_wait_s = prefix_wait_s
        self._incompatible: set[tuple[str, str]] = set()   # (source, target): other models
        # model -> its tokens per estimated token (its tokenizer against 4 chars a token),
        # from the last prompt a backend reported: puts prefixes in flight on the index's scale
        self._scale: dict[str, float] = {}
        # backend -> predicted / reported cached tokens and mispredictions, for /status
        self.truth: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        # benchmarks swap in other policies (bench/routing.py)
        self.policy: Policy = functools.partial(decide, policy=balance)

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        assert ex.parsed is not None
        ex.model = ex.trace.model = self.model_for(ex.parsed.req.model)
        chain = boundaries(ex.prepared.segments if ex.prepared is not None else [])
        lane = ex.prepared.lane if ex.prepared is not None else None
        refused: list[str] = []
        restarted = False
        while True:
            decision = self.decide(ex.model, lane, chain, exclude=refused)
            if not refused:
                await self._wait_for_prefix(ex.model, decision.name, chain)
            ex.transfer = self.transfer_plan(ex.model, decision.name, chain)
            try:
                await self._serve(ex, call_next, decision, chain, lane)
                break
            except BackendGone as e:
                # Nothing reached that backend (its connection was refused: killed, restarting):
                # it lost its cache, and another backend of the model may take the request.
                self._forget(decision.name)
                refused.append(decision.name)
                ex.trace.queue_wait = None       # it waits again, in the next backend's queue
                if len(refused) >= len(self.index[ex.model]):
                    # none left but a managed worker that restarts itself: once, its successor
                    if restarted or not await self._restarted(decision.name):
                        raise ApiError(502, str(e), code="upstream_error") from None
                    restarted = True
                    refused.remove(decision.name)
        if ex.trace.status == 200 and chain.bounds:
            if ex.transferred > decision.predicted:
                decision = dataclasses.replace(decision, predicted=ex.transferred)
            self.learn(decision, chain, ex.usage, lane, ex.model)

    async def _serve(self, ex: Exchange, call_next: Next, decision: Decision, chain: Chain,
                     lane: str | None) -> None:
        """The rest of the pipeline on the chosen backend (a llama-server's slot book told)."""
        ex.backend = self.backends[decision.name]
        ex.trace.backend = decision.name
        if ex.prepared is not None and ex.prepared.report is not None:
            ex.prepared.report.predicted_cached_tokens = decision.predicted
            ex.prepared.header = header(ex.prepared.report)
        slots = ex.backend.slots()        # a llama-server's: it may pin a slot when sent
        placed = (slots.expect(ex.trace.request_id, lane, decision.predicted)
                  if slots is not None and lane else None)
        self.inflight.add(decision.name, ex, chain)
        try:
            await call_next(ex)
            if slots is not None and placed is not None and ex.trace.status == 200:
                await slots.learn(placed, ex.usage)
        finally:
            self.inflight.remove(decision.name, ex)
            if slots is not None and placed is not None:
                slots.done(placed)

    async def _restarted(self, name: str) -> bool:
        """Whether `name` is a backend that restarts itself (a managed worker) and is ready
        again now."""
        backend = self.backends[name]
        if not getattr(backend, "restarts_itself", False):
            return False
        try:
            await backend.ensure_ready()
        except BackendUnavailable:
            return False
        return True

    def model_for(self, requested: str | None) -> str:
        """The served model for a request's `model`; 400/404 naming what is served."""
        model = resolve_model(requested, self.index, self.aliases)
        if model is not None:
            return model
        if requested is None:
            raise ApiError(400, "'model' is required: this proxy serves "
                           f"{sorted(self.index)}", param="model", code="missing_field")
        raise ApiError(404, f"model {requested!r} is not served here; available: "
                       f"{sorted(self.index)} (PREFIXD_MODEL_ALIASES maps other names)",
                       param="model", code="model_not_found", type_="invalid_request_error")

    def decide(self, model: str, lane: str | None, chain: Chain,
               exclude: list[str] | tuple[str, ...] = ()) -> Decision:
        now = time.monotonic()
        names = [n for n in self.index[model] if n not in exclude]
        for n in names:
            self._check_epoch(n)
        held = self.prefixes.longest(chain, now) if chain.bounds else {}
        cands = []
        for n in names:
            q = self.queues[n]
            tokens, own = held.get(n, (0, False))
            cands.append(Candidate(n, self.backends[n].status().available,
                                   q.waiting + q.in_flight, q.max_concurrency,
                                   tokens if own else 0, tokens))
        decision = self.policy(cands, self.affinity.get(lane), chain.key or str(lane))
        if exclude:                       # sent again: the chosen backend refused it
            decision = dataclasses.replace(decision, reason="failover")
        self.affinity.set(lane, decision.name)
        m.ROUTE_DECISIONS.labels(decision.name, decision.reason).inc()
        m.ROUTE_PREDICTED_TOKENS.labels(decision.name).inc(decision.predicted)
        return decision

    def transfer_plan(self, model: str, target: str, chain: Chain) -> tuple[str, int] | None:
        """(source, tokens) when another worker of `model` holds or is computing at least
        `transfer_min_tokens` more of this request's prefix than `target` (both must move
        state: prefixd workers); None otherwise."""
        if not self.transfer_min_tokens or not chain.bounds or \
                not getattr(self.backends[target], "moves_state", False):
            return None
        held = self.prefixes.longest(chain, time.monotonic())
        have = {}
        for n in self.index[model]:
            b = self.backends[n]
            if n == target or (getattr(b, "moves_state", False) and b.status().up
                               and (n, target) not in self._incompatible):
                have[n] = max(held.get(n, (0, False))[0], self._computing(model, n, chain)[0])
        return transfer_source(target, have, self.transfer_min_tokens)

    def _computing(self, model: str, name: str, chain: Chain) -> tuple[int, Any]:
        """(tokens of `chain`'s prefix a request `name` is computing shares, on the index's
        scale: the model's tokens per estimated token; that request's end event)."""
        tokens, done = self.inflight.computing(name, chain)
        return round(tokens * self._scale.get(model, 1.0)), done

    async def _wait_for_prefix(self, model: str, name: str, chain: Chain) -> None:
        """A llama-server (slots, several at once) computing a long prefix of this request
        that it does not hold yet: wait (at most `prefix_wait_s`) until that request ends, so
        this one restores the prefix from the server's RAM prompt cache instead of computing
        it again in another slot (slots share no KV; an idle slot is saved when a task
        starts)."""
        backend = self.backends[name]
        if not self.prefix_wait_s or backend.slots() is None or \
                self.queues[name].max_concurrency <= 1:
            return
        tokens, done = self._computing(model, name, chain)
        held = self.prefixes.longest(chain, time.monotonic()).get(name, (0, False))[0]
        if done is None or tokens - held < (self.transfer_min_tokens or WAIT_MIN_TOKENS):
            return
        try:
            async with asyncio.timeout(self.prefix_wait_s):
                await done.wait()
            outcome = "done"
        except TimeoutError:
            outcome = "timeout"
        m.PREFIX_WAITS.labels(name, outcome).inc()

    def transferred(self, source: str, target: str, tokens: int,
                    incompatible: bool = False) -> None:
        """What a planned transfer did (the transfer stage reports it)."""
        if incompatible:
            self._incompatible.add((source, target))
        if tokens:
            self.truth[target]["transferred_tokens"] += tokens

    def pick(self, model: str, lane: str | None) -> Backend:
        return self.backends[self.decide(model, lane, Chain([], 0)).name]

    def learn(self, decision: Decision, chain: Chain, usage: dict | None,
              lane: str | None = None, model: str | None = None) -> None:
        """The backend now holds this prompt; what it reported corrects the prediction."""
        usage = usage or {}
        prompt = _count(usage.get("prompt_tokens"))
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        truth = self.truth[decision.name]
        truth["predicted_tokens"] += decision.predicted
        truth["reported_tokens"] += cached or 0
        if cached is not None and cached + MISPREDICT_SLACK < decision.predicted:
            m.ROUTE_MISPREDICTIONS.labels(decision.name).inc()
            truth["mispredictions"] += 1
            self.prefixes.forget(decision.name, chain, after_tokens=cached)
        now = time.monotonic()
        if model and prompt and chain.bounds[-1].tokens > 0:
            self._scale[model] = prompt / chain.bounds[-1].tokens
        self.prefixes.record(decision.name, chain, now, prompt or None, _restorable(usage),
                             MISPREDICT_SLACK)
        if lane:
            self.prefixes.note(decision.name, lane, prompt or chain.bounds[-1].tokens, now)
        m.INDEX_ENTRIES.labels(decision.name).set(self.prefixes.size(decision.name))

    def _check_epoch(self, name: str) -> None:
        """A backend that restarted or went down lost its cache: forget its entries."""
        st = self.backends[name].status()
        epoch = (st.detail.get("restarts"), st.up, st.state)
        old = self._epochs.get(name)
        if old is not None and old != epoch and (not st.up or epoch[0] != old[0]):  # type: ignore[index]
            self._forget(name)
        self._epochs[name] = epoch

    def _forget(self, name: str) -> None:
        """`name` lost its cache (restarted, went down, refused a request)."""
        self.prefixes.forget(name)
        self._incompatible = {p for p in self._incompatible if name not in p}
        m.INDEX_ENTRIES.labels(name).set(0)

    def status(self, name: str) -> dict:
        """What /status shows of routing for a backend: its index (entries, conversations and
        their tokens, the largest first) and how its reported cached tokens met the
        predictions."""
        return {"index_entries": self.prefixes.size(name),
                "index": {**self.prefixes.summary(name, time.monotonic()),
                          **{k: self.truth[name][k] for k in TRUTH}}}


def _count(value: object) -> int | None:
    """A token count an upstream reported, if it is one (upstream data is not trusted)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**40:
        return value
    return None


def _restorable(usage: dict) -> Restorable | None:
    """A prefixd worker's digest of the prefixes it can restore (`prefixd.restorable`:
    `positions`, `prefix_to`, `any_prefix`); None when there is none, it is malformed, or any
    prefix restores (then every boundary counts, as for any other backend)."""
    worker = usage.get("prefixd")
    digest = worker.get("restorable") if isinstance(worker, dict) else None
    if not isinstance(digest, dict) or digest.get("any_prefix") is True:
        return None
    positions = digest.get("positions")
    if not isinstance(positions, list) or len(positions) > MAX_DIGEST:
        return None
    counts = [_count(p) for p in positions]
    prefix_to = _count(digest.get("prefix_to", 0))
    if prefix_to is None or any(c is None for c in counts):
        return None
    return Restorable(tuple(sorted(c for c in counts if c)), prefix_to)
