"""One running llama-server's slots as prefixd keeps them (`SlotKeeper`): what each slot holds
(the exact prompt tokens prefixd put there), which slots run a request, and the moves a
placement needs (save a slot into a slot file, restore one) before a request is pinned.

Made for each server process and dropped with it; the slot files (`SlotFiles`) outlive it.
`save_all()` runs before the server is stopped on purpose (an unload, a swap, prefixd's own
shutdown). Every request a keeper placed ends with `ran` (the slot now holds its prompt) or
`failed` (what the slot holds is unknown: it is treated as empty and unsaved-free).

Owns: the slots' bookkeeping and the counts of placements, saves and restores.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

from prefixd.backends.llama.api import LlamaAPI, SlotActionError
from prefixd.backends.llama.placement import Placement, SlotHeld, place
from prefixd.backends.llama.slotfiles import SlotFile, SlotFiles, common, pack
from prefixd.metrics import llama as m

log = logging.getLogger("prefixd.backend")


@dataclass
class Slot:
    tokens: bytes = b""      # the prompt it last ran (packed int32), or what was restored
    saved: bool = True       # a slot file holds it (nothing to lose)
    file: str | None = None  # ... that one (saved into, or restored from)
    busy: bool = False
    used: float = 0.0


@dataclass
class Placed:
    slot: int
    reason: str
    tokens: bytes
    expect: int


class SlotKeeper:
    def __init__(self, name: str, api: LlamaAPI, n_slots: int, files: SlotFiles | None,
                 whole_only: bool = False) -> None:
        """`whole_only`: the model's state resumes only at its end (recurrent layers, a
        sliding window: `command.WHOLE_ONLY`), so a slot or a file is worth its tokens to a
        prompt only when the prompt extends all of them."""
        self.name, self.api, self.files = name, api, files
        self.whole_only = whole_only
        self.slots = [Slot() for _ in range(n_slots)]
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = asyncio.Lock()           # one placement (and its moves) at a time

    async def place(self, tokens: list[int] | None) -> Placed | None:
        """Choose the slot for a request with these prompt tokens (None: unknown), save and
        restore what that needs, and mark the slot busy. None: every slot is busy."""
        async with self._lock:
            packed = pack(tokens) if tokens else b""
            best_file, file_tokens = (self.files.best(packed, self.whole_only)
                                      if self.files and packed else (None, 0))
            view = [SlotHeld(self._held(s.tokens, packed), len(s.tokens) // 4, s.saved,
                             s.busy, s.used) for s in self.slots]
            choice = place(view, file_tokens)
            if choice is None:
                return None
            slot = self.slots[choice.slot]
            slot.busy = True
            try:
                await self._moves(choice, slot, best_file)
            except BaseException:
                slot.busy = False
                raise
            reason = choice.reason if not choice.restore or slot.tokens else "fresh"
            self.counts[reason] += 1
            m.SLOT_PLACEMENTS.labels(self.name, reason).inc()
            return Placed(choice.slot, reason, packed, self._held(slot.tokens, packed))

    def _held(self, held: bytes, prompt: bytes) -> int:
        k = common(held, prompt)
        return 0 if self.whole_only and k < len(held) // 4 else k

    async def _moves(self, choice: Placement, slot: Slot, best: SlotFile | None) -> None:
        if choice.save_first:
            await self._save(choice.slot, slot)
        if choice.source is not None:             # copy: the source's prompt, through a file
            source = self.slots[choice.source]
            held = self.files.files.get(source.file or "") if self.files else None
            best = held if source.saved and held is not None else \
                await self._save(choice.source, source)
        if choice.restore and best is not None:
            await self._restore(choice.slot, slot, best)

    async def _restore(self, index: int, slot: Slot, f: SlotFile) -> None:
        """Restore `f` into the slot after it checks out; a miss leaves the slot to compute
        the prompt (counted by why, the file dropped)."""
        assert self.files is not None
        outcome = await asyncio.to_thread(self.files.check, f)
        slot.tokens, slot.saved, slot.file = b"", True, None   # whatever happens next
        if outcome == "hit":
            try:
                done = await self.api.slot_action(index, "restore", f.name)
            except SlotActionError as e:
                log.warning("backend %s: %s", self.name, e)
                outcome = "failed"
                await asyncio.to_thread(self.files.drop, f, "restore_failed")
            else:
                if done.tokens != f.n_tokens:
                    outcome = "damaged"
                    await asyncio.to_thread(self.files.drop, f, "damaged")
                else:
                    slot.tokens, slot.file = f.tokens, f.name
                    await asyncio.to_thread(self.files.used, f)
        self.counts[f"restore_{outcome}"] += 1
        m.SLOT_RESTORES.labels(self.name, outcome).inc()
        if outcome != "hit":
            log.info("backend %s: slot file %s not restored (%s): the prompt is computed",
                     self.name, f.name, outcome)

    async def _save(self, index: int, slot: Slot) -> SlotFile | None:
        """Save a slot into a new slot file: the file, once indexed."""
        if self.files is None or not slot.tokens:
            return None
        name = self.files.new_name()
        try:
            done = await self.api.slot_action(index, "save", name)
        except SlotActionError as e:
            log.warning("backend %s: %s", self.name, e)
            self.counts["save_failed"] += 1
            m.SLOT_SAVES.labels(self.name, "failed").inc()
            return None
        f = await asyncio.to_thread(self.files.added, name, done.tokens)
        outcome = "saved" if f is not None else (
            "too_large" if done.bytes > self.files.budget else "unreadable")
        self.counts[f"save_{outcome}"] += 1
        m.SLOT_SAVES.labels(self.name, outcome).inc()
        m.SLOT_FILE_BYTES.labels(self.name).set(self.files.size)
        if f is not None:                   # what it holds, exactly (the reply's tokens too)
            slot.tokens, slot.saved, slot.file = f.tokens, True, f.name
        return f

    def ran(self, placed: Placed) -> None:
        """The request answered: its slot holds its prompt now (and tokens it generated)."""
        slot = self.slots[placed.slot]
        slot.tokens, slot.saved, slot.file = placed.tokens, not placed.tokens, None
        slot.busy, slot.used = False, time.monotonic()

    def failed(self, placed: Placed) -> None:
        """The request did not answer whole: what its slot holds is unknown."""
        slot = self.slots[placed.slot]
        slot.tokens, slot.saved, slot.busy, slot.file = b"", True, False, None
        slot.used = time.monotonic()

    def overwritten(self, index: int) -> None:
        """A client named this slot itself: what it holds next is unknown."""
        if 0 <= index < len(self.slots):
            slot = self.slots[index]
            slot.tokens, slot.saved, slot.file = b"", True, None

    async def save_all(self) -> int:
        """Before the server stops: every slot holding what no file holds is saved. The
        number saved."""
        async with self._lock:
            n = 0
            for i, slot in enumerate(self.slots):
                if not slot.saved and slot.tokens and await self._save(i, slot) is not None:
                    n += 1
            if n:
                log.info("backend %s: saved %d slot(s) before stopping", self.name, n)
            return n

    def status(self) -> dict:
        slots = [{"id": i, "tokens": len(s.tokens) // 4, "saved": s.saved, "busy": s.busy}
                 for i, s in enumerate(self.slots)]
        return {"whole_only": self.whole_only, "slots": slots, "placements": dict(self.counts)}
