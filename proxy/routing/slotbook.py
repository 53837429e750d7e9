"""Which llama-server slot a conversation's request is sent to: the pure decision
(`decide_slot`) and one server's book of which conversation each slot holds (`SlotBook`),
learned only from what happened, and `locate` (where an unpinned request ran, from `/slots`).

llama-server keeps one prompt per slot (`-np N`). A request that names no slot gets the idle
slot whose prompt is most similar (`-sps`, default 0.10) or else the least recently used one,
and then the server's RAM prompt cache (`--cache-ram`, default 8 GiB) saves what that slot
held and restores the saved prompt that best matches the request. A request that names its
slot (`id_slot`) skips the RAM cache. So prefixd names a slot only where that is sure to help:
the conversation's last slot still holds its prompt (nothing else ran there since), or the
server has a slot per active conversation and a spare one for a new conversation. Everywhere
else the server places the request, and prefixd reads back where (`GET /slots`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from prefixd.backends.llama.info import SlotState

ACTIVE_S = 300.0          # a conversation with a request this recent is active
UNKNOWN = "?"             # a slot holding a prompt no conversation of ours is known to own


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
    own_fresh: bool = True     # no request was sent to the server since its slot's ended
    keeps_idle: bool | None = True   # idle slots keep their prompts when other requests
                                     # start (None: not known yet; False: they are cleared)
    probing: bool = False      # a pin finding that out is running


@dataclass(frozen=True)
class Pin:
    slot: int | None           # the `id_slot` to send, or None: the server places it
    reason: str                # holds_prefix | probe | spare_slot | taken | server
                               # | unsettled | probing | cleared | single_slot | untrusted
                               # | client


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

    A server may clear its idle slots whenever another request starts (llama-server's
    defaults: a unified KV cache with `--cache-idle-slots` saves them to its RAM cache and
    clears them), and a pin to a cleared slot computes the whole prompt. Until that is known,
    a conversation's slot is pinned when no request started since its last one ended
    (`own_fresh`), and one pin at a time across other requests finds out (`probe`). Where
    slots are cleared nothing is pinned (`cleared`): the server's own placement and RAM cache
    do better there than any pin (measured: 1.47 against 2.04 of the ideal with fresh-slot
    pins, whose requests race other requests the server has not started yet).
    """
    if v.total <= 1:
        return Pin(None, "single_slot")       # nothing to choose
    if not v.trusted:
        return Pin(None, "untrusted")
    if not v.settled:
        return Pin(None, "unsettled")
    if v.keeps_idle is False:
        return Pin(None, "cleared")
    if v.own is not None and v.own_intact:
        if v.own_fresh or v.keeps_idle:
            return Pin(v.own, "holds_prefix")
        if not v.probing:
            return Pin(v.own, "probe")
        return Pin(None, "probing")
    if v.own is None and v.active <= v.total and v.spare is not None:
        return Pin(v.spare, "spare_slot")
    return Pin(None, "taken" if v.own is not None else "server")


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
        self.fresh = [False] * total      # its request ended and none was sent since
        self.keeps_idle: bool | None = None
        self.probing = False
        self.certain = True       # no request ran where the book could not tell

    def view(self, lane: str, now: float, settled: bool = True) -> SlotView:
        own = self.lanes.get(lane, (None, 0.0))[0]
        active = self._active(now) | {lane}
        spares = [s for s in range(self.total)
                  if self.holder[s] is not None and self.holder[s] not in active]
        spare = min(spares, key=lambda s: self.used[s]) if spares else None
        return SlotView(self.total, len(active), own,
                        own is not None and self.holder[own] == lane, spare, settled,
                        self.trusted, own is not None and self.fresh[own], self.keeps_idle,
                        self.probing)

    def sent(self) -> None:
        """A request is being sent to the server: no idle slot is fresh any more."""
        self.fresh = [False] * self.total

    def ended(self, slot: int) -> None:
        """A request that ran in `slot` ended: it holds that prompt, fresh."""
        if 0 <= slot < self.total:
            self.fresh[slot] = True

    def probed(self, hit: bool) -> None:
        """A pin across other requests hit (idle slots keep prompts) or missed."""
        self.probing = False
        if self.keeps_idle is None:
            self.keeps_idle = hit

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
        if pin.reason not in ("holds_prefix", "probe") or cached is None or predicted < 64:
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
