"""A decode batch's next pass launched as soon as this one's tokens are read (pipelined
decode): the part of the batch executor (`executor.Batch`) that overlaps the Python work
between two passes with the next pass's compute.

Owns: `Launched` (the pass fed with the last pass's draws, evaluated in the background by
`mx.async_eval`), when a batch may launch one (`may_launch`) and when it pays (`Worth`, the
`decode_ahead` setting), and taking it back (`undo`). Each request then detokenizes, checks
its stops and sends its text while the launched pass runs; stock mlx-lm's batch generator
overlaps the same way. Where the next step would verify drafts (the width its members'
offers get, `company.width`), nothing is launched; drafts the batch would decline launch it.

Why it is exact: the launched pass feeds each row the token its greedy draw picked (the
argmax of its logits, the token the request yields next), so when the next step feeds the same
rows the same tokens it is that step's pass, computed earlier. Anything else (a member ends, a
newcomer joins, a member's draft is verified, a stop string starts, a checkpoint or a copy of
a row is taken) first takes the launched pass back: full-attention KV trimmed by its one
position, recurrent and convolution states replaced by the arrays they held before it (an
mlx array is never written in place: the references kept are the state). Sliding windows
cannot go back (their one-token step overwrote the oldest position), so a batch holding one
never launches; nor one with a sampled row (its draw is its sampler's, not the argmax), an
MTP head (it reads each pass's hidden states), or a group's (its ranks would have to agree on
every pass launched).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.batch import rows
from prefixd.backends.mlx.engine.batch.gapped import GappedKVCache
from prefixd.backends.mlx.engine.spec.row import argmax_rows

if TYPE_CHECKING:
    from prefixd.backends.mlx.engine.live.state import Live


@dataclass
class Launched:
    """A pass launched for the next step: its rows, the token each was fed (the last pass's
    draws, known once read), its logits and greedy draws (lazy until the step uses them), and
    the recurrent leaves as they were before it."""

    members: list[Live]
    fed: list[int]             # the token each row was fed (the last pass's draw)
    logits: mx.array           # [rows, vocab]
    argmax: mx.array           # [rows] its own draws
    before: snapshot.Snapshot

    def fits(self, runs: list[Live]) -> bool:
        """Whether the next step feeds exactly these rows these tokens."""
        return len(runs) == len(self.members) and all(
            a is b and not a.prompt_pending and a.pending == t
            for a, b, t in zip(runs, self.members, self.fed, strict=True))


@dataclass
class Worth:
    """Whether launching a batch's next pass early pays, learned as the batch runs (pure, no
    mlx): a pass launched and used saves the time between two steps (`between`: the jobs'
    Python work after a pass, which then overlaps the next), one taken back loses a whole
    pass (`passing`: a plain step's pass, not overlapped). `mode` "auto" launches while
    (1 - undone) x between > undone x passing (`undone`: the share taken back), and at every
    `PROBE`th chance regardless (what is taken back changes with the requests: ends, joins,
    drafts); "on" always, "off" never. On 2 CPU cores the built-in 135M model's pass (~65 ms
    for 4 rows) leaves ~2 ms between steps, so a pass taken back in 1 of 10 costs more than
    the overlap saves; a tiny model's 2 ms pass leaves ~0.5 ms: it pays."""

    mode: str = "auto"
    between: float | None = None
    passing: float | None = None
    undone: float = 0.1
    chances: int = field(default=0, repr=False)
    WEIGHT = 0.1
    PROBE = 16

    def pays(self) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        self.chances += 1
        if self.between is None or self.passing is None or self.chances % self.PROBE == 0:
            return True
        return (1 - self.undone) * self.between > self.undone * self.passing

    def gap(self, seconds: float) -> None:
        """The time between the end of a step and the start of the next."""
        self.between = _average(self.between, seconds, self.WEIGHT)

    def passed(self, seconds: float) -> None:
        """A plain step's pass, evaluated whole (nothing launched behind it)."""
        self.passing = _average(self.passing, seconds, self.WEIGHT)

    def outcome(self, used: bool) -> None:
        self.undone = _average(self.undone, 0.0 if used else 1.0, self.WEIGHT)


def _average(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


def may_launch(cache: list[Any], members: list[Live], plain: list[bool]) -> bool:
    """Whether the batch's next pass may be launched now: every leaf goes back by one
    position, every row draws greedily with nothing between its logits and its draw, no
    row's drafter reads hidden states, and no row is at its last token (it ends: the pass
    would be taken back)."""
    if len(members) < 2 or not all(plain):
        return False
    for leaf in snapshot.leaves(cache):   # the exact classes `undo` takes back (`rows.back`)
        kind = type(leaf)
        if kind is ArraysCache:
            if leaf.left_padding is not None or leaf.lengths is not None:
                return False
        elif kind is not BatchKVCache and kind is not GappedKVCache:
            return False
    return all((r.spec is None or not r.spec.config.watches)
               and r.max_tokens - r.sampled > 1 for r in members)


def launch(model: Any, cache: list[Any], members: list[Live], argmax: mx.array,
           fed: list[int]) -> Launched:
    """The next pass of `members` fed `argmax` (this pass's draws: `fed`), evaluated in the
    background; its rows' draws as `argmax_rows` draws them."""
    states = tuple(i for i, leaf in enumerate(snapshot.leaves(cache))
                   if type(leaf) is ArraysCache)
    before = snapshot.take(cache, states)[0]
    logits = model(argmax[:, None], cache=cache)[:, -1, :]
    out = Launched(list(members), fed, logits, argmax_rows(logits), before)
    mx.async_eval([leaf.state for leaf in snapshot.leaves(cache)], out.logits, out.argmax)
    return out


def undo(cache: list[Any], launched: Launched) -> None:
    """The batch's caches as they were before `launched` (its one position dropped from
    every row)."""
    rows.back(cache, [0] * len(launched.members), 1, None, launched.before)
