"""The router the proxy owns: the routing core (`core.py`) over `prefixd serve`'s backends and
their queues, and what only the proxy can do besides.

Owns, beside the core's state (endpoints, prefix index, affinity, truth): the backends' snapshots
(taken from their status and queues at every request: `update`), the requests each backend is
computing now (`inflight.py`), transfer planning between prefixd workers, the llama-server slot
planners (`slots.py`), and what `/status` shows of all that.

A request gets one `RouteView` (its model, lane, prefix chain, and what each backend holds of
it: the index is read once per request); each attempt at serving it (`proxy/attempt.py`) gets a
`Decision` from that view. After a complete answer, what the backend reported corrects the
index (`learn`). A backend whose cache was lost (restarted, went down, refused a request) is
forgotten.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from prefixd.backends.base import Backend, BackendUnavailable
from prefixd.metrics import proxy as m
from prefixd.proxy.attempt import Attempt, TransferPlan
from prefixd.proxy.queue import BackendQueue
from prefixd.proxy.routing.core import Endpoint, Reported, RouteView, RoutingCore, core_args
from prefixd.proxy.routing.index import Chain
from prefixd.proxy.routing.inflight import InFlight
from prefixd.proxy.routing.policy import Decision, transfer_source
from prefixd.proxy.routing.slots import SlotPlanner
from prefixd.proxy.settings import Settings

WAIT_MIN_TOKENS = 256     # a shared prefix worth waiting for when transfers are off

__all__ = ["RouteView", "Router"]


class Router(RoutingCore):
    def __init__(self, backends: dict[str, Backend], queues: dict[str, BackendQueue],
                 settings: Settings) -> None:
        super().__init__(*core_args(settings))
        self.backends, self.queues = backends, queues
        self.transfer_min_tokens = settings.route_transfer_min_tokens
        self.prefix_wait_s = settings.route_prefix_wait_s
        self.inflight = InFlight()                  # what each backend is computing now
        self._planners: dict[str, SlotPlanner] = {}      # llama-servers with slots
        self._incompatible: set[tuple[str, str]] = set()   # (source, target): other models
        self.update(self._snapshots())

    def _snapshots(self) -> list[Endpoint]:
        out = []
        for name, b in self.backends.items():
            st, q = b.status(), self.queues[name]
            out.append(Endpoint(name, tuple(b.models), st.available, q.waiting + q.in_flight,
                                q.max_concurrency, st.generation, st.up))
        return out

    # --- a request's view, and each attempt's decision ----------------------------------------
    def view(self, model: str, lane: str | None, chain: Chain,
             tokens: Sequence[int] | None = None) -> RouteView:
        self.update(self._snapshots())
        return super().view(model, lane, chain, tokens)

    def decide(self, view: RouteView, exclude: list[str] | tuple[str, ...] = ()) -> Decision:
        """The backend for the next attempt (`exclude`: those that refused it already)."""
        self.update(self._snapshots())
        return self.ranked(view, exclude)[0]

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
        # not (`scheduler/policy/schedule.py`: `share`), and only until the prefix is computed
        if not self.prefix_wait_s or self.queues[name].max_concurrency <= 1 or \
                backend.slot_info() is None:
            return False
        planner = self.planner(name)
        if planner is not None and planner.book.keeps_idle is False:
            return False        # it clears idle slots: the held ones would not find it
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
        if planner is not None and (view.lane or planner.keeper is not None):
            attempt.placement = planner.expect(request_id, view.lane or "",
                                               attempt.decision.predicted)
            await planner.occupy()

    async def pin(self, attempt: Attempt, raw: bytes, request_id: str) -> bytes:
        """The bytes to send for the attempt: with a slot pin (or marker) where that helps.
        A managed llama-server may have (re)started only now (`ensure_ready`): its planner
        expects the request here then."""
        name = attempt.backend.name
        keeper = attempt.backend.slot_keeper()
        planner = self.planner(name) if keeper is not None else self._planners.get(name)
        if planner is None:
            return raw
        if planner.keeper is not None and not planner.expects(request_id):
            attempt.placement = planner.expect(request_id, "", attempt.decision.predicted)
        if attempt.placement is None:
            return raw
        return await planner.prepare(attempt.placement.request_id, raw)

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
        usage = attempt.usage
        reported = Reported(usage.prompt, usage.cached, usage.worker) if usage else None
        self.outcome(view, attempt.decision, reported, attempt.transferred)

    def forget(self, name: str) -> None:
        """`name` lost its cache (restarted, went down, refused a request)."""
        super().forget(name)
        self._incompatible = {p for p in self._incompatible if name not in p}

    def status(self, name: str, sees: Callable[[str], bool] = lambda lane: True) -> dict:
        """What /status shows of routing for a backend: its index (`index_status`) and a
        llama-server's slots."""
        planner = self.planner(name)
        return {**self.index_status(name, sees),
                **(planner.status() if planner is not None else {})}
