"""Which slot of a managed llama-server a request runs in, and what moves first: the pure
decision (`place`) over what each slot holds and what the best slot file holds.

A request named to a slot (`id_slot`) skips llama-server's RAM prompt cache, so prefixd
brings the prefix itself: every request is pinned to

- the idle slot holding the longest start of its prompt, when no slot file holds more;
- else the idle slot whose loss costs least, with the file restored into it first.

A slot is overwritten only after what it holds is saved (unless a slot file already holds
it, or the request extends it: the same conversation's next turn). Each way is worth the tokens
the request finds cached less `MOVE_COST` per save or restore it needs, so a few shared tokens
(a chat template's opening) never evict another conversation while an empty slot waits; ties go
to the slot whose loss costs least (what must be saved), then the least recently used.
"""

from __future__ import annotations

from dataclasses import dataclass

MOVE_COST = 32          # a save or a restore, counted as this many computed tokens


@dataclass(frozen=True)
class SlotHeld:
    """What the keeper knows of one slot."""

    held: int            # tokens of the slot's prompt that the request shares
    size: int            # tokens the slot holds (its last prompt)
    saved: bool          # a slot file holds what it holds (or it holds nothing)
    busy: bool
    used: float          # when it last ran a request


@dataclass(frozen=True)
class Placement:
    slot: int
    reason: str          # holds_prefix | restore | fresh
    restore: bool        # restore the best slot file into it first
    save_first: bool     # save what it holds first
    expect: int          # tokens the request should find cached there


def loss(s: SlotHeld) -> int:
    """Tokens that must be saved before `s` can take another prompt."""
    return 0 if s.saved else s.size


def place(slots: list[SlotHeld], file_tokens: int) -> Placement | None:
    """Where a request goes, given each slot's share of its prompt and the longest start a
    slot file holds (`file_tokens`); None when every slot is busy."""
    idle = [i for i, s in enumerate(slots) if not s.busy]
    if not idle:
        return None

    def tie(i: int) -> tuple[int, float]:
        return loss(slots[i]), slots[i].used

    best = max(idle, key=lambda i: (slots[i].held - MOVE_COST * _must_save(slots[i],
                                                                            slots[i].held),
                                    tuple(-x for x in tie(i))))
    value = slots[best].held - MOVE_COST * _must_save(slots[best], slots[best].held)
    cheapest = min(idle, key=tie)
    restored = file_tokens - MOVE_COST * (1 + _must_save(slots[cheapest], 0))
    if file_tokens and restored > value:
        return Placement(cheapest, "restore", True, _must_save(slots[cheapest], 0), file_tokens)
    held = slots[best].held
    return Placement(best, "holds_prefix" if held else "fresh", False,
                     _must_save(slots[best], held), held)


def _must_save(s: SlotHeld, kept: int) -> bool:
    """Save the slot first unless nothing would be lost: it is saved already, or the
    request keeps all it holds."""
    return not s.saved and s.size > 0 and kept < s.size
