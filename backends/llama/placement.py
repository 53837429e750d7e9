"""Which slot of a managed llama-server a request runs in, and what moves first: the pure
decision (`place`) over what each slot holds and what the best slot file holds.

A request named to a slot (`id_slot`) skips llama-server's RAM prompt cache, so prefixd
brings the prefix itself. Every request is pinned; the ways to place it:

- `holds_prefix`: the idle slot holding the longest start of its prompt (its own slot, for a
  conversation's next turn);
- `copy`: that slot holds another conversation: it is saved into a slot file and the file is
  restored into a free slot, so the other conversation keeps its slot (a shared system prompt
  reaches a new conversation without evicting anyone);
- `restore`: a slot file holds more than any slot: restored into the slot whose loss costs
  least;
- `fresh`: nothing holds any of it: the slot whose loss costs least.

Each way is worth the tokens the request finds cached less `MOVE_COST` per save or restore it
needs now or causes later: a conversation displaced from its slot costs a save (unless a slot
file holds it already) and a restore when it comes back. So a few shared tokens (a chat
template's opening) never displace a conversation while an empty slot waits. Ties go to the
slot whose loss costs least, then to the least recently used.
"""

from __future__ import annotations

from dataclasses import dataclass

MOVE_COST = 32          # a save or a restore, counted as this many computed tokens
# on equal worth: a copy keeps the other conversation in its slot (a displaced one's restore
# later is likely, not certain); a file is restored last
_RANK = {"copy": 0, "holds_prefix": 1, "fresh": 1, "restore": 2}


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
    reason: str          # holds_prefix | copy | restore | fresh
    restore: bool        # restore a slot file into it first (copy: the source's)
    save_first: bool     # save what it holds first
    expect: int          # tokens the request should find cached there
    source: int | None = None   # copy: the slot whose prompt is saved and restored here


def moves(s: SlotHeld, kept: int) -> int:
    """Saves and restores that running a request in `s` costs, keeping `kept` of its
    tokens: none when the request extends what it holds; else a save (unless a file holds
    it) and its conversation's restore later."""
    if s.size == 0 or kept >= s.size:
        return 0
    return 1 + (not s.saved)


def place(slots: list[SlotHeld], file_tokens: int) -> Placement | None:
    """Where a request goes, given each slot's share of its prompt and the longest start a
    slot file holds (`file_tokens`); None when every slot is busy."""
    idle = [i for i, s in enumerate(slots) if not s.busy]
    if not idle:
        return None

    def tie(i: int) -> tuple[int, float]:
        return moves(slots[i], 0), slots[i].used

    cheapest = min(idle, key=tie)
    options: list[tuple[int, int, tuple[int, float], Placement]] = []

    def offer(worth: int, at: int, p: Placement) -> None:
        options.append((worth, -_RANK[p.reason], tuple(-x for x in tie(at)), p))  # type: ignore[arg-type]

    for i in idle:
        s = slots[i]
        cost = moves(s, s.held)
        offer(s.held - MOVE_COST * cost, i,
              Placement(i, "holds_prefix" if s.held else "fresh", False,
                        cost > 0 and not s.saved, s.held))
        free = [c for c in idle if c != i and moves(slots[c], 0) < cost]
        if s.held and cost and free:
            c = min(free, key=tie)
            offer(s.held - MOVE_COST * (1 + (not s.saved) + moves(slots[c], 0)), c,
                  Placement(c, "copy", True, moves(slots[c], 0) == 2, s.held, source=i))
    if file_tokens:
        cost = moves(slots[cheapest], 0)
        offer(file_tokens - MOVE_COST * (1 + cost), cheapest,
              Placement(cheapest, "restore", True, cost == 2, file_tokens))
    return max(options, key=lambda o: o[:3])[3]
