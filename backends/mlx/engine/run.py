"""One generation's live model state: prefill (cut at checkpoint positions) and decode.

Owns: the live cache of the running request, how far it got (`pos` prompt tokens and the `fed`
generated tokens are in it), and whether an exception left it in an unknown state (`broken`).
Knows nothing of the checkpoint store: the Engine says where to capture (`marks`) and what to do
there (`capture`), and commits `tokens` with `cache` when the run ends. With `inpass` (the
model passed `tap.verify`), a pass is not cut at marks: the marks inside it are captured from
the pass itself (`engine/inpass/tap.py`), so checkpoints add no forward passes.

The steps are typed: a prefill pass yields `Prefilled` when it ends, `Paused(layer)` when it
stops between two layers, a decode step the token it sampled. Each step goes in with what it
runs on, sent into the generator as it resumes (`_sent`): the `Plan` that sizes its passes (the
scheduler decides it, `scheduler/policy/schedule.py`; nothing here sizes passes but the marks
that cut them), or what a decode batch's pass left for it (`live.fed.Fed`).

A prefill pass can pause in the middle (`pacing.preempt`, from the worker's scheduler): its
graph is built whole, then evaluated a layer at a time (the cache leaves in layer order), and
between two layers `preempt()` may say another job should run first. The pass then waits as it
is, its residual stream (tokens x hidden size) the only activation it keeps; evaluated later, it
gives exactly what it gives unpaused (the same graph, the same operations on the same inputs).
A request's first prefill pass can instead be taken back in its first layers (`pacing.regroup`,
asked after 1, 2, 4, ... layers, on a cache of full-attention KV alone): each layer's KV goes
back to the arrays it held before the pass (`Regrouped`), so that requests that arrived in the
same instant prefill with it in one pass; what is lost is the layers it ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.batch.passes import PassCounts
from prefixd.backends.mlx.engine.batch.prefill import regroups
from prefixd.backends.mlx.engine.inpass import tap
from prefixd.backends.mlx.engine.live.fed import Fed
from prefixd.backends.mlx.engine.live.stops import Stops
from prefixd.backends.mlx.engine.pacing import (
    Pacing,
    Paused,
    Plan,
    Prefilled,
    Ready,
    Regrouped,
    Sent,
)
from prefixd.backends.mlx.engine.stats import PromptStats

# Called at each mark the prefill reaches: (position, is an in-message interval mark, the
# checkpoint payload when the pass computed it (an in-pass mark), else None: take it from the
# live cache, which is at that position).
# a checkpoint inside a pass whose tap failed: not taken (a group's ranks all skip it)
LOST: Any = {"lost": True}
Capture = Callable[[int, bool, "snapshot.Snapshot | None"], None]


Step = Prefilled | Ready | Paused | int   # an int: the token a decode step sampled
Forward = tuple[mx.array, dict[int, "snapshot.Snapshot"]]   # logits, in-pass checkpoints


class Run(Stops):
    """One generation: its live state (`Live`), its prefill's own state, and its steps."""

    def __init__(self, model: Any, cache: list[Any], prompt: list[int], start: int,
                 pacing: Pacing, should_stop: Callable[[], bool],
                 inpass: tuple[int, ...] | None = None, passes: PassCounts | None = None,
                 publish: Callable[[int], None] = lambda pos: None) -> None:
        super().__init__(model, cache, prompt, start, should_stop)
        self.pacing, self.passes, self.publish = pacing, passes or PassCounts(), publish
        self.plan = Plan(0)   # its steps' first plan or the last sent in, read as passes start
        self.yields = 0  # how many times a prefill pass paused in the middle
        # what its first token is drawn from, once prefilled: the prompt's last logits (and
        # the token drawn from them, where a decode batch's pass fed that last token)
        self.opening: Fed | None = None
        self.inpass = inpass  # the snapshotted leaves, when marks are captured inside passes
        self.tap_failure: str | None = None  # why a pass's in-pass checkpoints were not built
        self.segments: list[tuple[int, float]] = []  # (tokens, seconds) of each prefill pass
        self.ended = False   # committed and let go (`Engine.end`)
        # a first pass of it was offered to be taken back (`_regroups`, or a shared one's)
        self.regrouped = False

    def _sent(self, got: Sent) -> Fed | None:
        """What its steps were resumed with: a new plan is kept for the passes from here on;
        what a decode batch's pass left for it is returned (None: nothing)."""
        if isinstance(got, Plan):
            self.plan = got
            return None
        return got

    def release(self) -> None:
        """`Live.release`, and the prompt's last logits."""
        super().release()
        self.opening = None

    def saw(self, start: int, n: int) -> None:
        """Its last pass's hidden states at positions start..start + n to its drafter."""
        if self.spec is not None and self.hidden is not None:
            self.spec.saw(start, self.hidden, 0, n)
        self.hidden = None

    @property
    def advanced(self) -> bool:
        """Whether the cache holds more than the state it was restored from."""
        return self.pos > self.start or bool(self.fed)

    def _forward(self, tokens: list[int], logits: bool = True,
                 offsets: tuple[int, ...] = ()) -> Forward:
        """The model over `tokens`; with `logits`, the last position's, evaluated together with
        the cache and the checkpoints at `offsets` inside the pass (one sync)."""
        try:
            next(self._forward_steps(tokens, logits, offsets, staged=False))
        except StopIteration as done:
            assert done.value is not None   # only a staged pass is taken back
            return done.value
        raise AssertionError("an unstaged forward never pauses")

    def _forward_steps(self, tokens: list[int], logits: bool, offsets: tuple[int, ...],
                       staged: bool) -> Generator[Paused, None, Forward | None]:
        """`_forward`; `staged` (a prefill pass with a `preempt`): evaluated a cache leaf (a
        layer) at a time, pausing between two when `preempt()` says so."""
        self.broken = True
        before = self._first_pass() if staged and not logits else None
        recorder = tap.Tap(offsets, len(tokens)) if offsets and self.inpass is not None else None
        with tap.tapping(recorder):
            out = self.model(mx.array(tokens)[None], cache=self.cache)
        # taken before it may pause (other jobs' passes would leave theirs)
        hidden = self.spec.config.taken() if self.spec is not None else None
        self.hidden = hidden if logits else None
        last = out[:, -1, :] if logits else None
        snaps = recorder.payloads(self.cache, self.inpass or ()) if recorder else {}
        if recorder is not None and recorder.failed:
            self.tap_failure = self.tap_failure or recorder.failed
        if before is not None and self._regroups(before):
            yield Regrouped(0, len(self.cache))
            return None
        del before     # the pass's first layer no longer keeps the buffers it wrote into
        preempt = self.pacing.preempt
        if staged and preempt is not None and self.plan.pausable:
            leaves = snapshot.leaves(self.cache)
            for layer, leaf in enumerate(leaves[:-1]):
                mx.eval(leaf.state)
                if preempt():
                    self.yields += 1
                    yield Paused(layer, len(leaves))
        snapshot.evaluate(self.cache, last, *(recorder.arrays(snaps) if recorder and snaps else ()))
        self.broken = False
        return (last if last is not None else out), snaps

    def _first_pass(self) -> list[tuple[Any, Any, int]] | None:
        """Each layer's KV before its first prefill pass, when that pass may be taken back
        (`pacing.regroup`, once: a cache of full-attention KV alone, which goes back by its
        arrays; none of its passes ran)."""
        if self.pacing.regroup is None or self.regrouped or self.pos != self.start or \
                self.fed or not all(type(c) is KVCache for c in self.cache):
            return None
        return [(c.keys, c.values, c.offset) for c in self.cache]

    def _regroups(self, before: list[tuple[Any, Any, int]]) -> bool:
        """Whether the pass is taken back (`prefill.regroups`), its cache then as `before`."""
        assert self.pacing.regroup is not None
        self.regrouped = True
        leaves = snapshot.leaves(self.cache)
        if not regroups(len(leaves), lambda i: mx.eval(leaves[i].state), self.pacing.regroup):
            return False
        for c, (keys, values, offset) in zip(self.cache, before, strict=True):
            c.keys, c.values, c.offset = keys, values, offset
        self.broken, self.hidden = False, None
        self.passes.regrouped += 1
        return True

    def prefill_passes(self, marks: dict[int, bool], final: int, capture: Capture,
                       plan: Plan) -> Generator[Prefilled | Ready | Paused, Sent, None]:
        """Run prompt[pos:] through the model, ending a pass at every mark and calling
        `capture` there; the last pass runs from `final` (or from where the prefill is, if
        beyond) to the end. One forward pass per step: `Prefilled` after each pass but the
        last, `Paused` between two layers of one when `preempt()` says so (a scheduler may run
        other jobs' passes then; the live cache waits as it is); the last pass leaves the
        last token's logits in `logits` (None if should_stop() ended it). Where the last pass
        is the last token alone (no checkpoint after it), `Ready` comes first: the token waits
        as `pending`, and a decode pass may feed it as a row of its batch (its logits then
        come from that pass, sent in as it resumes, and no pass of its own runs). A pass is
        `plan.tokens` (`plan`, or the one sent in since, read before each pass); checkpoints
        land at the same positions whatever the pass sizes (marks inside a pass are captured
        in it, or the pass is cut there)."""
        n, self.plan = len(self.prompt), plan
        # a mark inside a pass costs nothing where passes capture them (`inpass`): the last
        # pass is then the last token, which can ride a decode pass
        final = n - 1 if self.inpass is not None else min(max(final, self.pos), n - 1)
        cuts = [] if self.inpass is not None else sorted(p for p in marks
                                                          if self.pos < p < final)
        self.opening = None
        while self.pos < final:
            if self.should_stop():
                return
            start = self.pos
            share = self.plan.share
            end = min([final, self.pos + max(1, self.plan.tokens),
                       *(p for p in cuts if p > self.pos),
                       *((share,) if self.pos < share < final else ())])
            # Prefill logits are never evaluated, so lm_head over the chunk is never computed.
            if (yield from self._pass(end, marks, capture)) is None:
                continue   # taken back (`Regrouped`): a shared pass may have run it since
            if end == share:       # others wait for this prefix: stored now
                self.publish(end)
            mx.clear_cache()
            self._sent((yield Prefilled(end - start)))
        if self.should_stop():
            return
        if self.pos == n - 1:   # its last token: in a decode pass, or alone
            self.pending, self.prompt_pending = self.prompt[-1], True
            fed = self._sent((yield Ready()))
            if fed is not None:      # a decode pass fed it (its row in the batch)
                self.opening = fed
                if n in marks:
                    capture(n, marks[n], None)   # from its row of the batch
                return
            self.pending, self.prompt_pending = None, False
            if self.should_stop():
                return
        last = yield from self._pass(n, marks, capture, logits=True)
        self.opening = Fed(last) if last is not None else None

    def _pass(self, end: int, marks: dict[int, bool], capture: Capture,
              logits: bool = False) -> Generator[Paused, Sent, mx.array | None]:
        """One prefill pass over prompt[pos:end], timed (its own time: not while it waited
        half-evaluated), then the captures of the marks it reached; with `logits`, the last
        position's logits, evaluated with the cache."""
        t0, own, start = time.perf_counter(), 0.0, self.pos
        inner = tuple(p - start for p in sorted(marks) if start < p < end)
        steps = self._forward_steps(self.prompt[start:end], logits, inner, staged=True)
        while True:
            try:
                paused = next(steps)
            except StopIteration as done:
                if done.value is None:     # taken back: nothing of it is in the cache
                    return None
                out, snaps = done.value
                break
            own += time.perf_counter() - t0
            self._sent((yield paused))
            t0 = time.perf_counter()
        self.segments.append((end - start, own + time.perf_counter() - t0))
        self.passes.prefill(end - start)
        self.pos = end
        self.saw(start, end - start)
        for r in inner if self.inpass is not None else ():   # a failed tap loses them all
            capture(start + r, marks[start + r], snaps.get(r, LOST))
        if end in marks:
            capture(end, marks[end], None)
        return out

    def decode(self, opening: Fed, stats: PromptStats) -> Generator[int, Sent, None]:
        """Sample, yield the token, feed it: alone (a forward pass of its own, or a verify pass
        of it and a draft, `engine/spec/speculate.py`, when `spec` drafts), or, when a `Batch` fed
        it with others' before this step resumed, from what that pass left for it, sent in as
        it resumes (`Fed`: its row's logits and the token drawn from them in the same
        evaluation, or the tokens its verify pass emits). After a verify pass the tokens it
        accepted are yielded one per step, with no pass between them. Its sampler, processors
        and `max_tokens` are set before its prefill (a decode pass that feeds its prompt's last
        token draws its first token: `opening`)."""
        fed: Fed | None = opening
        for i in range(self.max_tokens):
            t0 = time.perf_counter()
            if self.ahead:       # accepted in a verify pass (all but the last are in the cache)
                token = self.ahead.pop(0)
                self.pending = None if self.ahead else token
            else:
                assert fed is not None
                token = self.pending = int(fed.drawn if fed.drawn is not None
                                           else self.draw(fed.logits))
            if i == 0:
                stats.first_token_s = time.perf_counter() - t0
            self.sampled = i + 1
            got = self._sent((yield token))
            if self.ahead:
                continue
            if got is not None:      # a batch fed it
                fed, self.ahead = got, list(got.ahead)
                continue
            if not self.wants_feed():
                return
            # a run decoding in a batch drafts in the batch's step (`Batch.verify`), not here
            room = self.max_tokens - self.sampled - 1   # drafted tokens it may still yield
            spec = self.spec if self.batch is None and room > 0 else None
            self.settle()
            draft = spec.draft(self, token, room) if spec is not None else []
            t0 = time.perf_counter()
            if draft and spec is not None:
                self.ahead, self.pending = spec.verify(self, token, draft), None
                self.passes.verify(1, len(self.ahead), spec.went_back_by())
                self.passes.drafts(len(draft), len(self.ahead) - 1, spec.kind)
                self.batched += len(self.ahead)
                continue
            logits, _ = self._forward([token])
            fed = Fed(logits)
            if self.spec is not None:
                self.spec.config.costs.observe(1, time.perf_counter() - t0)
                self.saw(self.pos + len(self.fed), 1)
            self.passes.decode(1)
            self.batched += 1
            self.fed.append(token)
            self.pending = None

    def feed_pending(self) -> None:
        """Feed the last yielded token on a normal end (max_tokens, or the caller closing the
        generator at EOS or a stop string), so the cache covers the whole reply and the next
        turn starts after it. Not when should_stop() ended the request (the client left), nor
        when it ended beside others in a decode batch (`feed_last`: they would wait through
        that pass; the next turn prefills that token). Tokens a verify pass accepted and
        nobody yielded leave the cache first. Raises what the model raises (the run is then
        `broken`)."""
        if self.prompt_pending:   # it ended before its last prompt token was fed: left out
            self.pending, self.prompt_pending = None, False
            return
        unyielded = len(self.ahead) - 1
        if unyielded > 0 and self.spec is not None and not self.broken \
                and self.spec.go_back(self, self.spec.held - unyielded):
            del self.fed[-unyielded:]
        self.ahead = []
        token, self.pending = self.pending, None
        if token is None or self.broken or self.should_stop() or not self.feed_last:
            return
        self._forward([token], logits=False)
        self.batched += 1
        self.fed.append(token)

