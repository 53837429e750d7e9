"""One llama-server's slots as routing sees them (`SlotPlanner`): a request is announced when
its attempt starts (`expect`), pinned or marked when it is sent (`prepare`, inside its queue
slot, so the book already knows where every earlier request ran), and learned from after a
good answer (`learn`); `done` always. The router owns one planner per server, made when the
backend reports slots (`Backend.slot_info()`) and dropped when it restarts.

A managed llama-server (kind `llama`) has a slot keeper (`Backend.slot_keeper()`): there every
request is pinned to the slot that holds its prefix, by its exact prompt tokens, with slot
files saved and restored as the keeper decides (`backends/llama/placement.py`). Elsewhere the
planner's own book decides (`slotbook.py`), from conversations (lanes) and what it learned.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from prefixd.api.usage import Usage
from prefixd.backends.base import Backend
from prefixd.backends.llama.info import ServerInfo
from prefixd.backends.llama.keeper import Placed
from prefixd.metrics.proxy import SLOT_PINS
from prefixd.proxy.bodies import with_field
from prefixd.proxy.routing.slotbook import Pin, SlotBook, decide_slot, locate

log = logging.getLogger("prefixd.backend")   # the server's own behaviour


@dataclass
class Placement:
    """One request of a conversation on this server, from routing to its answer."""

    request_id: str
    lane: str
    predicted: int               # cached tokens the prefix index expects on this server
    pin: Pin | None = None       # decided when the request is sent
    marker: int | None = None    # the seed it was sent with, to find it in /slots
    learned: bool = False        # where it ran is known
    placed: Placed | None = None  # where a slot keeper put it
    located: int | None = None   # the slot /slots showed it running in


class SlotPlanner:
    """One llama-server's slots: its book, the pins decided, what was measured."""

    def __init__(self, backend: Backend, info: ServerInfo) -> None:
        self.name, self.info, self._backend = backend.name, info, backend
        self._occupied_read = False              # what the slots held when it was made
        self.book = SlotBook(info.total_slots)
        self.pins: dict[str, int] = {}
        self._pending: dict[str, Placement] = {}
        self._unlocated: dict[str, Placement] = {}   # sent unpinned, not located yet
        self.takeover_seen = False               # measured: it selects slots by similarity
        self.keeper = backend.slot_keeper()      # a managed server's: slot-exact placement
        self.exact = {"requests": 0, "expected": 0, "cached": 0}   # keeper pins, measured

    async def occupy(self) -> None:
        """Once: slots holding prompts the book knows nothing of (it just came up, or other
        clients use it) are nobody's to pin to."""
        if not self._occupied_read and self.keeper is None:
            self._occupied_read = True
            self.book.occupied(await self._backend.fetch_slots())

    def expects(self, request_id: str) -> bool:
        return request_id in self._pending

    def expect(self, request_id: str, lane: str, predicted: int) -> Placement:
        p = Placement(request_id, lane, predicted)
        self._pending[request_id] = p
        return p

    async def prepare(self, request_id: str, body: bytes) -> bytes:
        """The bytes to send for an expected request: with `id_slot` where a pin helps (a
        slot keeper's server: always, after the keeper's saves and restores)."""
        p = self._pending.get(request_id)
        if p is None or p.pin is not None:
            return body
        if self.keeper is not None:
            return await self._place(p, body)
        if self._unlocated:
            await self._locate_running()
        now = time.monotonic()
        if b'"id_slot"' in body:         # the client chose: where it runs is learned after
            p.pin = Pin(None, "client")
        else:
            p.pin = decide_slot(self.book.view(p.lane, now, settled=not self._unlocated))
        self.book.seen(p.lane, now)
        self.book.sent()
        if p.pin.reason == "probe":
            self.book.probing = True
        self.pins[p.pin.reason] = self.pins.get(p.pin.reason, 0) + 1
        SLOT_PINS.labels(self.name, p.pin.reason).inc()
        if p.pin.slot is not None:
            self.book.placed(p.lane, p.pin.slot, now)
            return with_field(body, "id_slot", p.pin.slot)
        self._unlocated[p.request_id] = p
        if self.info.total_slots > 1 and p.pin.reason != "client" and b'"seed"' not in body:
            # The server shows each slot's last seed: a random one (what it would draw
            # itself for a request without one) tells which slot this request ran in.
            p.marker = random.randrange(1, 1 << 31)
            return with_field(body, "seed", p.marker)
        return body

    async def _locate_running(self) -> None:
        """Where the requests the server placed itself went: a slot shows the seed of the
        task it took as soon as it takes it, so the book is settled again (and pins resume)
        without waiting for those requests to end."""
        marked = {p.marker: p for p in self._unlocated.values() if p.marker is not None}
        if not marked:
            return
        slots = await self._backend.fetch_slots()
        now = time.monotonic()
        for s in slots:
            p = marked.pop(s.seed, None) if s.seed is not None else None
            if p is not None and self._unlocated.pop(p.request_id, None) is not None:
                self._check_takeover(p.lane, s.id)
                self.book.placed(p.lane, s.id, now)
                p.learned, p.located = True, s.id

    async def _place(self, p: Placement, body: bytes) -> bytes:
        assert self.keeper is not None
        if b'"id_slot"' in body:              # the client chose: the keeper forgets that slot
            p.pin = Pin(None, "client")
            try:
                slot = json.loads(body).get("id_slot")
            except (ValueError, AttributeError):
                slot = None
            if isinstance(slot, int):
                self.keeper.overwritten(slot)
        else:
            try:
                tokens = await self._backend.tokenize(json.loads(body))
            except ValueError:
                tokens = None
            p.placed = await self.keeper.place(tokens)
            p.pin = Pin(None, "server") if p.placed is None else \
                Pin(p.placed.slot, p.placed.reason)
        self.pins[p.pin.reason] = self.pins.get(p.pin.reason, 0) + 1
        SLOT_PINS.labels(self.name, p.pin.reason).inc()
        return body if p.pin.slot is None else with_field(body, "id_slot", p.pin.slot)

    async def learn(self, p: Placement, usage: Usage | None) -> None:
        """After a good answer: a pin's hit or miss; where an unpinned request ran."""
        if p.pin is None:
            return
        if p.placed is not None and self.keeper is not None:
            self.keeper.ran(p.placed)
            p.learned = True
            if usage is not None and usage.cached is not None:
                self.exact["requests"] += 1
                self.exact["expected"] += p.placed.expect
                self.exact["cached"] += usage.cached
            return
        if self.keeper is not None:
            return
        usage = usage or Usage()
        prompt, cached, completion = usage.prompt, usage.cached, usage.completion
        if p.pin.reason == "probe" and cached is not None:
            self.book.probed(2 * cached >= p.predicted)
            if self.book.keeps_idle is False:
                log.info("backend %s: llama-server clears idle slots when another request "
                         "starts (a unified KV cache with --cache-idle-slots: its defaults); "
                         "prefixd pins a conversation to its slot only when no other request "
                         "started since, else leaves it to the server's RAM cache", self.name)
        if p.pin.slot is not None:
            self.book.ended(p.pin.slot)
        if self.book.outcome(p.pin, cached, p.predicted):
            log.warning("backend %s: llama-server slots do not keep a conversation between "
                        "its turns (idle slots cleared: --kv-unified with --cache-idle-slots?); "
                        "prefixd leaves slot placement to the server", self.name)
        if p.pin.slot is not None:
            p.learned = True
            return
        if p.learned:                     # located while it ran
            if p.located is not None:
                self.book.ended(p.located)
            return
        try:
            slot = locate(await self._backend.fetch_slots(), prompt, cached, completion,
                          p.marker)
        except Exception:
            slot = None
        if slot is not None and self._unlocated.pop(p.request_id, None) is not None:
            self._check_takeover(p.lane, slot)
            self.book.placed(p.lane, slot, time.monotonic())
            self.book.ended(slot)
            p.learned = True

    def _check_takeover(self, lane: str, slot: int) -> None:
        """Measure what /props does not say: the server put a request into another
        conversation's slot while a slot was empty. Its least-recently-used pick takes empty
        slots first, so it chose by prompt similarity (-sps > 0)."""
        book, held = self.book, self.book.holder[slot]
        if (self.info.similarity is None and not self.takeover_seen and book.certain
                and held is not None and held != lane and None in book.holder):
            self.takeover_seen = True
            log.warning("backend %s: llama-server put a conversation into another one's slot "
                        "while a slot was empty, so it picks slots by prompt similarity "
                        "(-sps > 0), which discards the other conversation's cache: restart it "
                        "with -sps 0", self.name)

    def done(self, p: Placement) -> None:
        """The request ended (answered, failed or abandoned)."""
        self._pending.pop(p.request_id, None)
        if p.pin is not None and p.pin.reason == "probe" and self.book.probing:
            self.book.probing = False         # it failed: the next intact pin asks again
        if p.placed is not None and not p.learned and self.keeper is not None:
            self.keeper.failed(p.placed)
        if p.pin is None or p.pin.slot is not None or self.keeper is not None:
            return
        self._unlocated.pop(p.request_id, None)
        if not p.learned:
            self.book.lost(p.lane)

    def status(self) -> dict[str, Any]:
        out = {"slots": self.info.total_slots, "slot_similarity": self.info.similarity,
               "cache_ram_mib": self.info.cache_ram_mib, "slot_pins": dict(self.pins),
               "slot_takeover_seen": self.takeover_seen,
               "slot_pins_trusted": self.book.trusted}
        if self.keeper is not None:        # slot-exact: what the pins expected and found
            out["slot_exact"] = dict(self.exact)
        return out
