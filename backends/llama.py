"""llama-server's slots (issue 17, item 4): what prefixd learns of them, and when it names
the slot a conversation runs in.

llama-server keeps one prompt per slot (`-np N`). A request that names no slot gets the idle
slot whose prompt is most similar (`-sps`, default 0.10) or else the least recently used one,
and then the server's RAM prompt cache (`--cache-ram`, default 8 GiB) saves what that slot
held and restores the saved prompt that best matches the request. A request that names its
slot (`id_slot`) skips the RAM cache. So prefixd names a slot only where that is sure to help:
the conversation's last slot still holds its prompt (nothing else ran there since), or the
server has a slot per active conversation and a spare one for a new conversation. Everywhere
else the server places the request, and prefixd reads back where (`GET /slots`).

Owns: parsing `/props` and `/slots`, the one start-up advice line, the pure pin decision
(`decide_slot`), and one backend's book of which conversation each slot holds. A
conversation is an opaque key here (this package imports nothing of the proxy).
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prefixd.metrics.proxy import SLOT_PINS

log = logging.getLogger("prefixd.backend")

ACTIVE_S = 300.0          # a conversation with a request this recent is active
MIN_CACHE_RAM_MIB = 1024  # a smaller --cache-ram holds next to no conversation of an agent
UNKNOWN = "?"             # a slot holding a prompt no conversation of ours is known to own


@dataclass(frozen=True)
class ServerInfo:
    """What a llama-server says of itself in `/props` (settings it does not report: None)."""

    total_slots: int
    n_ctx: int | None = None            # per slot
    similarity: float | None = None     # -sps / --slot-prompt-similarity
    cache_ram_mib: int | None = None    # --cache-ram
    build: str = ""


@dataclass(frozen=True)
class SlotState:
    """One entry of `GET /slots`."""

    id: int
    n_ctx: int | None
    is_processing: bool
    id_task: int | None = None
    n_prompt_tokens: int = 0           # what the slot holds now (prompt + generated)
    n_cached: int | None = None        # its last task: prompt tokens it reused ...
    n_processed: int | None = None     # ... and computed
    seed: int | None = None            # ... and its sampling seed


def _num(*dicts: Any, keys: tuple[str, ...]) -> float | None:
    for d in dicts:
        if isinstance(d, dict):
            for k in keys:
                v = d.get(k)
                if isinstance(v, int | float) and not isinstance(v, bool):
                    return v
    return None


def parse_props(obj: Any) -> ServerInfo | None:
    """A llama-server's `/props`, or None when the answer is not one (no `total_slots`)."""
    if not isinstance(obj, dict):
        return None
    total = obj.get("total_slots")
    if not isinstance(total, int) or isinstance(total, bool) or total < 1:
        return None
    dgs = obj.get("default_generation_settings")
    params = dgs.get("params") if isinstance(dgs, dict) else None
    n_ctx = _num(dgs, obj, keys=("n_ctx",))
    sim = _num(obj, dgs, params, keys=("slot_prompt_similarity", "sps"))
    ram = _num(obj, dgs, params, keys=("cache_ram_mib", "cache_ram"))
    return ServerInfo(total, None if n_ctx is None else int(n_ctx), sim,
                      None if ram is None else int(ram), str(obj.get("build_info") or ""))


def parse_slots(obj: Any) -> list[SlotState]:
    """`GET /slots` (a list of slots; anything else: no slots)."""
    out = []
    for s in obj if isinstance(obj, list) else []:
        if not isinstance(s, dict) or not isinstance(s.get("id"), int):
            continue

        def i(key: str, s: dict = s) -> int | None:
            v = s.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        params = s.get("params")
        seed = params.get("seed") if isinstance(params, dict) else None
        out.append(SlotState(s["id"], i("n_ctx"), bool(s.get("is_processing")), i("id_task"),
                             i("n_prompt_tokens") or 0, i("n_prompt_tokens_cache"),
                             i("n_prompt_tokens_processed"),
                             seed if isinstance(seed, int) else None))
    return out


def advice(name: str, info: ServerInfo) -> tuple[int, str]:
    """The one line logged when a backend turns out to be llama-server: what it has, and
    the flag to change where its settings defeat caching (WARNING then, else INFO)."""
    ctx = f" of {info.n_ctx} tokens" if info.n_ctx else ""
    head = f"backend {name}: llama-server with {info.total_slots} slot(s){ctx}"
    fixes = []
    if info.similarity is not None and info.similarity > 0:
        fixes.append(f"-sps {info.similarity:g} lets a new conversation take over the slot "
                     "of a similar one without saving it: restart with -sps 0")
    if info.cache_ram_mib is not None and 0 <= info.cache_ram_mib < MIN_CACHE_RAM_MIB:
        what = "disables" if info.cache_ram_mib == 0 else "leaves almost no room for"
        fixes.append(f"--cache-ram {info.cache_ram_mib} {what} its RAM prompt cache, so "
                     "conversations beyond its slots recompute: restart with --cache-ram 8192 "
                     "(or more)")
    if fixes:
        return logging.WARNING, f"{head}; {'; '.join(fixes)}"
    unknown = [f for f, v in (("-sps", info.similarity), ("--cache-ram", info.cache_ram_mib))
               if v is None]
    if unknown:
        return logging.INFO, (f"{head}; it does not report {' or '.join(unknown)}: for cache "
                              "reuse run it with -sps 0 and --cache-ram 8192 (the default) or "
                              "more")
    return logging.INFO, f"{head}; -sps 0 and a RAM prompt cache: slot settings keep caches"


# --- the decision -------------------------------------------------------------------------

@dataclass(frozen=True)
class SlotView:
    """What the decision sees of one conversation on one server."""

    total: int                 # slots the server has
    active: int                # conversations active on it, this one included
    own: int | None            # the slot this conversation ran in last, if known
    own_intact: bool           # ... and nothing else ran there since: it holds the prefix
    spare: int | None          # the least recently used slot whose prompt no active
                               # conversation needs (empty slots are not spare: see below)
    settled: bool = True       # every request the server placed itself has been located
    trusted: bool = True       # pins to intact slots have been hitting


@dataclass(frozen=True)
class Pin:
    slot: int | None           # the `id_slot` to send, or None: the server places it
    reason: str                # holds_prefix | spare_slot | taken | server | unsettled
                               # | single_slot | untrusted | client


def decide_slot(v: SlotView) -> Pin:
    """Name a slot only where it helps.

    - the conversation's last slot still holds its prompt: that slot (reused whole, no copy
      through the RAM cache, and no other slot's prompt is moved out for it);
    - a new conversation, a slot per active conversation, and a spare slot with a prompt no
      active conversation needs: that one, so no active conversation loses its slot;
    - otherwise none: the server picks, and its RAM cache restores the conversation (a named
      slot would skip the restore). Never-used slots are left to the server too: its
      least-recently-used pick takes them first and seeds them from the RAM cache (a shared
      system prompt), where a named empty slot would compute everything.

    No pin either while a request the server placed itself runs unlocated: it may be running
    in (or about to take) the very slot the book believes intact, and a pinned request would
    wait for that slot and find someone else's prompt there.
    """
    if v.total <= 1:
        return Pin(None, "single_slot")       # nothing to choose
    if not v.trusted:
        return Pin(None, "untrusted")
    if not v.settled:
        return Pin(None, "unsettled")
    if v.own is not None and v.own_intact:
        return Pin(v.own, "holds_prefix")
    if v.own is None and v.active <= v.total and v.spare is not None:
        return Pin(v.spare, "spare_slot")
    return Pin(None, "taken" if v.own is not None else "server")


# --- one server's book --------------------------------------------------------------------

class SlotBook:
    """slot -> the conversation whose prompt it holds; conversation -> its last slot.

    Learned only from what happened: a pinned request ran in its slot; an unpinned one ran
    where `/slots` says (`locate`), or somewhere unknown, which voids what the book knew.
    """

    def __init__(self, total: int, capacity: int = 4096, active_s: float = ACTIVE_S) -> None:
        self.total, self.capacity, self.active_s = total, capacity, active_s
        self.holder: list[str | None] = [None] * total
        self.used: list[float] = [float("-inf")] * total
        self.lanes: OrderedDict[str, tuple[int | None, float]] = OrderedDict()
        self.trusted = True
        self.misses = 0
        self.certain = True       # no request ran where the book could not tell

    def view(self, lane: str, now: float, settled: bool = True) -> SlotView:
        own = self.lanes.get(lane, (None, 0.0))[0]
        active = self._active(now) | {lane}
        spares = [s for s in range(self.total)
                  if self.holder[s] is not None and self.holder[s] not in active]
        spare = min(spares, key=lambda s: self.used[s]) if spares else None
        return SlotView(self.total, len(active), own,
                        own is not None and self.holder[own] == lane, spare, settled,
                        self.trusted)

    def seen(self, lane: str, now: float) -> None:
        """A request of `lane` is about to run (its slot unknown until placed/located)."""
        slot = self.lanes.get(lane, (None, 0.0))[0]
        self.lanes[lane] = (slot, now)
        self.lanes.move_to_end(lane)
        while len(self.lanes) > self.capacity:
            self.lanes.popitem(last=False)

    def placed(self, lane: str, slot: int, now: float) -> None:
        """`lane`'s request ran in `slot`: the slot holds its prompt now."""
        if not 0 <= slot < self.total:
            return
        old = self.lanes.get(lane, (None, 0.0))[0]
        if old is not None and old != slot and self.holder[old] == lane:
            self.holder[old] = UNKNOWN            # an older prompt of it, still there
        self.holder[slot], self.used[slot] = lane, now
        self.lanes[lane] = (slot, now)
        self.lanes.move_to_end(lane)

    def lost(self, lane: str) -> None:
        """`lane`'s request ran in a slot nobody knows: any slot may have been overwritten."""
        self.holder = [UNKNOWN if h is not None else None for h in self.holder]
        self.certain = False
        self.lanes[lane] = (None, self.lanes.get(lane, (None, 0.0))[1])

    def occupied(self, slots: list[SlotState]) -> None:
        """Slots the server reports holding a prompt that the book knows nothing of."""
        for s in slots:
            if 0 <= s.id < self.total and self.holder[s.id] is None and s.n_prompt_tokens:
                self.holder[s.id] = UNKNOWN

    def outcome(self, pin: Pin, cached: int | None, predicted: int) -> bool:
        """A pin to an intact slot hit or missed; two misses in a row: stop trusting such
        pins (the server clears idle slots, e.g. a unified KV cache). True on that change."""
        if pin.reason != "holds_prefix" or cached is None or predicted < 64:
            return False
        if cached * 2 >= predicted:
            self.misses = 0
            return False
        self.misses += 1
        if self.misses >= 2 and self.trusted:
            self.trusted = False
            return True
        return False

    def _active(self, now: float) -> set[str]:
        out = set()
        for lane, (_, seen) in reversed(self.lanes.items()):
            if now - seen > self.active_s:
                break
            out.add(lane)
        return out


def locate(slots: list[SlotState], prompt: int | None, cached: int | None,
           completion: int | None = None, seed: int | None = None) -> int | None:
    """The slot whose last task is the request that reported these counts: the one that
    shows its `seed` (a marker prefixd gave it), else the newest task whose reused/computed
    counts match where the server still shows them; llama-server clears them when the slot
    is released, and then what the slot holds is the prompt and the tokens it generated
    (the last one sampled, not decoded) — ambiguous among conversations of one length."""
    if seed is not None:
        marked = [s.id for s in slots if s.seed == seed]
        return marked[0] if len(marked) == 1 else None
    if prompt is None:
        return None

    def ran(s: SlotState) -> bool:
        if s.id_task is None:
            return False
        if s.n_processed:
            return s.n_cached == cached and (s.n_cached or 0) + s.n_processed == prompt
        held = prompt + (completion or 0)
        return held - 2 <= s.n_prompt_tokens <= held

    hits = [s for s in slots if ran(s)]
    if not hits:
        return None
    return max(hits, key=lambda s: s.id_task or 0).id


def usage_counts(usage: dict | None) -> tuple[int | None, int | None, int | None]:
    """(prompt_tokens, cached_tokens, completion_tokens) of an OpenAI usage object."""
    usage = usage or {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None

    def n(v: object) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    return n(usage.get("prompt_tokens")), n(cached), n(usage.get("completion_tokens"))


Fetch = Callable[[str], Awaitable[Any]]   # GET a path of the server -> its JSON (or None)


def with_field(raw: bytes, key: str, value: int) -> bytes:
    """The same JSON object with `"key": value` first, every other byte as it was."""
    start = raw.index(b"{") + 1
    empty = raw[start:].lstrip().startswith(b"}")
    field = b'"%s":%d' % (key.encode(), value)
    return raw[:start] + field + (b"" if empty else b",") + raw[start:]


@dataclass
class Placement:
    """One request of a conversation on this server, from routing to its answer."""

    request_id: str
    lane: str
    predicted: int               # cached tokens the prefix index expects on this server
    pin: Pin | None = None       # decided when the request is sent
    marker: int | None = None    # the seed it was sent with, to find it in /slots
    learned: bool = False        # where it ran is known


class LlamaSlots:
    """One llama-server's slots as prefixd sees them.

    The route stage announces a request (`expect`) and reports its end (`learn` after a
    good answer, `done` always). The pin is decided when the request is sent (`prepare`,
    called by the backend inside its queue slot), so the book already knows where every
    earlier request ran, or that one is still unlocated (then nothing is pinned).
    """

    def __init__(self, name: str, info: ServerInfo, fetch: Fetch,
                 slots: list[SlotState] | None = None) -> None:
        self.name, self.info, self._fetch = name, info, fetch
        self.book = SlotBook(info.total_slots)
        self.pins: dict[str, int] = {}
        self._pending: dict[str, Placement] = {}
        self._unplaced = 0                       # sent unpinned, not located yet
        self.takeover_seen = False               # measured: it selects slots by similarity
        if slots:
            self.book.occupied(slots)

    @classmethod
    async def detect(cls, name: str, fetch: Fetch) -> LlamaSlots | None:
        """A llama-server behind `fetch`, or None; logs the one advice line."""
        info = parse_props(await fetch("/props"))
        if info is None:
            return None
        slots = parse_slots(await fetch("/slots"))
        level, line = advice(name, info)
        log.log(level, "%s", line)
        return cls(name, info, fetch, slots)

    def expect(self, request_id: str, lane: str, predicted: int) -> Placement:
        p = Placement(request_id, lane, predicted)
        self._pending[request_id] = p
        return p

    def prepare(self, request_id: str, body: bytes) -> bytes:
        """The bytes to send for an expected request: with `id_slot` where a pin helps."""
        p = self._pending.get(request_id)
        if p is None or p.pin is not None:
            return body
        now = time.monotonic()
        if b'"id_slot"' in body:         # the client chose: where it runs is learned after
            p.pin = Pin(None, "client")
        else:
            p.pin = decide_slot(self.book.view(p.lane, now, settled=not self._unplaced))
        self.book.seen(p.lane, now)
        self.pins[p.pin.reason] = self.pins.get(p.pin.reason, 0) + 1
        SLOT_PINS.labels(self.name, p.pin.reason).inc()
        if p.pin.slot is not None:
            self.book.placed(p.lane, p.pin.slot, now)
            return with_field(body, "id_slot", p.pin.slot)
        self._unplaced += 1
        if self.info.total_slots > 1 and p.pin.reason != "client" and b'"seed"' not in body:
            # The server shows each slot's last seed: a random one (what it would draw
            # itself for a request without one) tells which slot this request ran in.
            p.marker = random.randrange(1, 1 << 31)
            return with_field(body, "seed", p.marker)
        return body

    async def learn(self, p: Placement, usage: dict | None) -> None:
        """After a good answer: a pin's hit or miss; where an unpinned request ran."""
        if p.pin is None:
            return
        prompt, cached, completion = usage_counts(usage)
        if self.book.outcome(p.pin, cached, p.predicted):
            log.warning("backend %s: llama-server slots do not keep a conversation between "
                        "its turns (idle slots cleared: --kv-unified with --cache-idle-slots?); "
                        "prefixd leaves slot placement to the server", self.name)
        if p.pin.slot is not None:
            p.learned = True
            return
        try:
            slot = locate(parse_slots(await self._fetch("/slots")), prompt, cached, completion,
                          p.marker)
        except Exception:
            slot = None
        if slot is not None:
            self._check_takeover(p.lane, slot)
            self.book.placed(p.lane, slot, time.monotonic())
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
        if p.pin is None or p.pin.slot is not None:
            return
        self._unplaced -= 1
        if not p.learned:
            self.book.lost(p.lane)

    def status(self) -> dict[str, Any]:
        return {"slots": self.info.total_slots, "slot_similarity": self.info.similarity,
                "cache_ram_mib": self.info.cache_ram_mib, "slot_pins": dict(self.pins),
                "slot_takeover_seen": self.takeover_seen,
                "slot_pins_trusted": self.book.trusted}
