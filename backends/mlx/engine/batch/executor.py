"""The batch executor: one forward pass of several requests' rows.

Owns: the decode batch (its members and their caches merged into mlx-lm's batch caches,
`BatchKVCache` left-padded to the longest, `BatchRotatingKVCache`, `ArraysCache` and
`CacheList` stacked on the batch axis; joining and leaving are `members.py`'s), and its
passes. While a run is in the batch its own `cache` is empty (the batch holds the only copy:
no memory twice); out of it, its checkpoints, commit, disk tier and transfers see no batch.

A step feeds every member's pending token (the one it sampled last; a newcomer's, its prompt's
last token: its prefill ends in the batch's pass, not in one of its own) in one pass of shape
[members, 1] and hands each member its row of logits (`live.fed.Fed`, which its caller sends into
the member's steps as they resume); each request then samples on its own (its sampler,
processors, seed, grammar). mlx-lm's masks keep each row's attention to its own tokens (left
padding masked), so a row's logits are those of the request alone up to kernel rounding
(measured: identical on the tiny qwen3, qwen3_next, qwen3_5 and falcon_h1; within 2e-5 in
log-probability on gemma3's sliding windows). A forward pass that raises leaves every member's
state unknown: each is marked `broken` (not cached) and the batch is emptied. With speculative
decoding, each member offers its draft and the pass's width is decided for all of them
(`engine/spec/company.py`); a step then carries every member's draft up to that width (`verify`,
rows padded to it), and each row goes back to its own last accepted token
(`engine/batch/rows.py`), on every cache kind.

Why mlx-lm's batch caches and not our own: they are the model classes' own masks and offsets
(per-row RoPE offsets, left padding), kept in step with every model mlx-lm adds. Why prefixd's
own loop around them rather than mlx-lm's `BatchGenerator`: a prefixd request's prefill is
preemptible, checkpointed and restored by the Engine (`engine/run.py`), and a group's ranks
journal every step; the passes are the scheduler's plan (`scheduler/policy/plan.py`), and a
member's cache is its own again the moment it leaves.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.batch import launch, rows
from prefixd.backends.mlx.engine.batch.members import Members
from prefixd.backends.mlx.engine.batch.passes import PassCounts
from prefixd.backends.mlx.engine.inpass import tap
from prefixd.backends.mlx.engine.inpass.captured import RowOf
from prefixd.backends.mlx.engine.live.fed import Fed
from prefixd.backends.mlx.engine.spec.company import BatchPace, Offer, width
from prefixd.backends.mlx.engine.spec.row import argmax_rows

if TYPE_CHECKING:
    from prefixd.backends.mlx.engine.live.state import Live
    from prefixd.backends.mlx.engine.spec.speculate import Speculation


def _room(run: Live, later: int = 0) -> int:
    """The drafted tokens it may still yield after its pending token, `later` tokens on."""
    return run.max_tokens - run.sampled - later - 1


def _offer(run: Live, rows: int) -> Offer | None:
    """What a batch member would verify after its pending token in a pass of `rows` requests
    (None: it feeds its pending token alone)."""
    room = _room(run)
    if run.spec is None or run.pending is None or run.prompt_pending or room <= 0:
        return None
    return run.spec.offer(run, run.pending, room, rows)


def _peek(run: Live, token: int) -> Offer | bool | None:
    """What it would offer at the batch's next step once `token` is its pending token
    (`_offer`), asked without changing its pace; True where a model drafter may draft (its
    draft is not known before it runs)."""
    room = _room(run, later=1)
    if run.spec is None or room <= 0:
        return None
    return True if run.spec.model is not None else run.spec.peek(run, token, room)


def _drafts(run: Live) -> Speculation | None:
    """Its speculation, when its row of a verify pass is its pending token and a draft (None:
    its pending token alone, a run that does not speculate or a newcomer's last prompt
    token)."""
    return None if run.prompt_pending else run.spec


def _timed(members: list[Live], tokens: int, t0: float) -> float:
    """A batch pass of `tokens` tokens (rows x width) took the time since `t0`: into the
    costs its members' drafts are sized by. The seconds (0: none of them speculates, or their
    costs are untimed: a group's, whose decisions may not depend on time)."""
    spec = next((r.spec for r in members if r.spec is not None), None)
    if spec is None or not spec.config.costs.timed:
        return 0.0
    seconds = time.perf_counter() - t0
    spec.config.costs.observe(tokens, seconds, len(members))
    return seconds


def _order(runs: list[Live], members: list[Live], fed: list[Fed]) -> list[Fed]:
    """What a pass left for each of `members` (in their order), in the order of `runs`."""
    by = {id(m): f for m, f in zip(members, fed, strict=True)}
    return [by[id(r)] for r in runs]


def _draw(run: Live, logits: mx.array) -> mx.array | None:
    try:
        return run.draw(logits)
    except Exception:
        return None


class Batch(Members):
    """The decoding runs stepped together (one forward pass per step)."""

    def __init__(self, model: Any, passes: PassCounts) -> None:
        self.model, self.passes = model, passes
        self.runs: list[Live] = []
        self.cache: list[Any] | None = None
        self.launched: launch.Launched | None = None
        self.pace = BatchPace()   # whether its members draft at all (each: its own pace)
        self.ahead = launch.Worth()   # whether its next pass is launched early (`launch.py`)
        self._left: float | None = None   # when its last plain step ended

    def step(self, runs: list[Live], drafts: bool = True) -> list[Fed]:
        """Feed each run's pending token in one forward pass: what it left for each run's next
        step (in the order of `runs`; its caller sends each into that run's steps as they
        resume): its row's logits and the token drawn from them, or what its draft's verify
        emits. Members not in `runs` leave first (their requests end).
        With drafts (`verify`), each run's draft goes through the same pass. Raises what the
        model raises (every member is then `broken` and out of the batch). A pass launched
        for this step (`launch.py`) is this step's pass when it fed these rows these tokens and
        nobody drafts; else it is taken back first."""
        entered = time.perf_counter()
        if self._left is not None:
            self.ahead.gap(entered - self._left)
            self._left = None
        ahead = self.launched if self.launched is not None and self.launched.fits(runs) \
            else None
        if ahead is None:
            self._settle()
        for run in [r for r in self.runs if r not in runs]:
            self.leave(run)
        self._join([r for r in runs if r not in self.runs])
        assert self.cache is not None
        members = list(self.runs)
        riders = sum(r.prompt_pending for r in members)
        self.passes.riders(riders)
        offers: list[Offer | None] = [_offer(r, len(members)) for r in members] \
            if drafts and self._verifies() and self.pace.drafts() else [None] * len(members)
        spec = next((r.spec for r, o in zip(members, offers, strict=True) if o is not None),
                    None)
        wide = width(offers, spec.config.costs) if spec is not None else 1
        if wide > 1:
            self._settle()
            ahead = None
        self.launched = None
        proposed = [o.tokens[:wide - 1] if o is not None else [] for o in offers]
        if wide == 1:
            for r, o in zip(members, offers, strict=True):
                if o is not None and r.spec is not None:
                    r.spec.declined()
        if wide > 1:     # one verify pass, each row's draft up to the width the pass has
            return _order(runs, members, self.verify(members, proposed))
        t0 = time.perf_counter()
        try:
            for r in members:
                r.broken = True
            if ahead is not None:
                logits, ready = ahead.logits, ahead.argmax
                self.passes.launched(True)
                self.ahead.outcome(True)
            else:
                logits = self.model(mx.array([[r.pending] for r in members]),
                                    cache=self.cache)[:, -1, :]
                ready = None
            hidden = next((r.spec.config.taken() for r in members if r.spec is not None), None)
            for i, r in enumerate(members):
                assert r.pending is not None
                if r.spec is not None:
                    r.spec.saw(r.pos + len(r.fed), hidden, i, 1)
                r.fed_pending()
            # each one's next token drawn in the same evaluation (one sync for the pass): the
            # greedy ones together, the others each with its own sampler; a member whose draw
            # cannot be built draws in its own step (and fails alone)
            plain = [r.plain for r in members]
            together = ready if ready is not None else \
                argmax_rows(logits) if sum(plain) > 1 else None
            drawn: list[mx.array | int | None] = [
                None if together is not None and p else _draw(r, logits[i:i + 1])
                for i, (r, p) in enumerate(zip(members, plain, strict=True))]
            snapshot.evaluate(self.cache, logits, *drawn,
                              *((together,) if together is not None else ()))
            if ahead is None:
                self.ahead.passed(time.perf_counter() - t0)
            if together is not None:
                argmaxes = cast(list[int], together.tolist())
                drawn = [argmaxes[i] if p else d
                         for i, (p, d) in enumerate(zip(plain, drawn, strict=True))]
                # the next pass launched now that its tokens are known: it computes while
                # the jobs detokenize, check their stops and send their text
                if not riders and self._launches(members, plain, argmaxes):
                    self.launched = launch.launch(self.model, self.cache, members, together,
                                                  argmaxes)
        except BaseException:
            self._break()
            raise
        self.passes.decode(len(members))
        self.pace.observe(len(members), False, len(members), _timed(members, len(members), t0))
        for r in members:
            r.batched += len(members)
            r.broken = False
        self._left = time.perf_counter()
        return _order(runs, members, [Fed(logits[i:i + 1], d) for i, d in enumerate(drawn)])

    def _launches(self, members: list[Live], plain: list[bool], tokens: list[int]) -> bool:
        """Whether the next pass of `members`, fed `tokens`, is launched now (`launch.py`):
        not where the next step would verify drafts (`would_verify`: it would take it back),
        and where launching pays (`Worth`). A step where a prompt ended launches
        nothing either (its checkpoint is taken of its row before the next step)."""
        assert self.cache is not None
        return launch.may_launch(self.cache, members, plain) and not (
            self._verifies() and self.would_verify(members, tokens)) and self.ahead.pays()

    def would_verify(self, members: list[Live], tokens: list[int]) -> bool:
        """Whether the next step would verify drafts (`company.width` over what each member
        would offer once `tokens` are pending), asked without changing any pace: a batch
        whose members offer drafts it would not verify still launches its next pass."""
        if not self.pace.would_draft():
            return False
        offers = [_peek(r, t) for r, t in zip(members, tokens, strict=True)]
        if any(o is True for o in offers):
            return True
        spec = next((r.spec for r, o in zip(members, offers, strict=True) if o is not None),
                    None)
        return spec is not None and width(cast(list[Offer | None], offers),
                                          spec.config.costs) > 1

    def _verifies(self) -> bool:
        """Whether drafts can be verified in this batch's passes: every row of every leaf can
        go back to any position of the pass on its own. Full-attention KV and sliding windows
        by a roll of the row into its padding; recurrent and convolution states (no batch
        padding) from their state at that position, captured in the pass by the in-pass tap
        (verified for this model: the speculating members' `leaves`)."""
        captured = next((r.spec.config.leaves for r in self.runs if r.spec is not None), ())
        return self.cache is not None and rows.verifiable(self.cache, captured)

    def verify(self, members: list[Live], drafts: list[list[int]]) -> list[Fed]:
        """One pass of every member's pending token and draft (rows padded to the longest):
        each accepts its drafted tokens while they equal its own draws (`Speculation.accept`),
        yields them and its first draw that differs (`Live.ahead`); then each row goes back to
        its last accepted token (`rows.back`). What it left for each member (`step`). Should
        the tap fail, the batch goes back to where it was and steps its pending tokens
        alone."""
        assert self.cache is not None
        t0 = time.perf_counter()   # all of it: the pass, its captures, going back
        xs = [[cast(int, r.pending), *d] for r, d in zip(members, drafts, strict=True)]
        starts = [r.pos + len(r.fed) for r in members]
        width = max(len(x) for x in xs)
        states = [i for i, leaf in enumerate(snapshot.leaves(self.cache))
                  if type(leaf) is ArraysCache]
        before = snapshot.take(self.cache, tuple(states))[0]
        rows.in_order(self.cache)
        config = next(r.spec.config for r in members if r.spec is not None)
        recorder = tap.Tap(tuple(range(1, width)), width, config.replays(self.cache, width)) \
            if states else None
        try:
            for r in members:
                r.broken = True
            padded = [[*x, *([x[-1]] * (width - len(x)))] for x in xs]
            with tap.tapping(recorder):
                logits = self.model(mx.array(padded), cache=self.cache)
            hidden = next((r.spec.config.taken() for r in members if r.spec is not None), None)
            captured = recorder.capture(self.cache, tuple(states)) if recorder else None
            if recorder is not None and recorder.failed:
                rows.back(self.cache, [0] * len(members), width, None, before)
                for r in members:
                    r.broken = False
                return self.step(members, drafts=False)
            # a member that does not speculate draws its next token as in `step`
            draws = [spec.draws(r, x, logits[i, :len(x)]) if (spec := _drafts(r)) else
                     [r.draw(logits[i, :1], r.tokens + x)]
                     for i, (r, x) in enumerate(zip(members, xs, strict=True))]
            snapshot.evaluate(self.cache, logits, *(d for row in draws for d in row),
                              *(captured.arrays() if captured else ()))
            kept, fed = [], []
            for i, (r, x, d) in enumerate(zip(members, xs, draws, strict=True)):
                if r.spec is not None:   # before accepting (`saw` replaces from `start` on)
                    r.spec.saw(starts[i], hidden, i, len(x))
                spec = _drafts(r)
                if spec is None:
                    r.fed_pending()
                    fed.append(Fed(logits[i, :1], d[0]))
                    kept.append(1)
                    continue
                a, emitted = spec.accept(r, x, d)
                fed.append(Fed(ahead=tuple(emitted)))
                spec.held = a + 1
                spec.captured = RowOf(captured, i) if captured else None
                self.passes.drafts(len(x) - 1, a, spec.kind)
                r.pending = None
                kept.append(a + 1)
            for r, k in zip(members, kept, strict=True):
                r.batched += len(members) * k
            squeezed = rows.back(self.cache, kept, width, captured)
            snapshot.evaluate(self.cache)
        except BaseException:
            self._break()
            raise
        self.passes.verify(len(members), sum(kept), "none" if recorder is None else
                           "recomputed" if recorder.replay else "kept", squeezed)
        self.pace.observe(len(members), True, sum(kept), _timed(members, len(members) * width, t0))
        for r in members:
            r.broken = False
        return fed
