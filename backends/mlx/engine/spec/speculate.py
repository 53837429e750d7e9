"""Speculative decoding of one request: a draft verified in one forward pass, and the live
cache brought back exactly to the last accepted token, on every cache type prefixd serves.

Owns: a run's drafter and pace (`engine/spec/draft.py`), the verify pass, the acceptance rule, and
the states it keeps to go back: per position of the pass, the recurrent and convolution states
(Gated-DeltaNet, Mamba, short convolutions) and sliding windows, captured inside the pass by
the in-pass tap (`engine/inpass/tap.py`, proven equal to a pass cut there at start-up);
full-attention
KV is trimmed. So the state after accepting `a` of `k` drafted tokens is the one `a + 1`
one-token passes would have left, never an approximation. Should the tap fail in a pass, the
snapshotted leaves go back to their state before it and the accepted tokens are fed again (one
more pass, the same state).

The acceptance rule. The drafter's draft is deterministic (a one-hot proposal), so standard
speculative sampling reduces to: draw the target's token at each position with the request's
own sampler (processors, penalties, temperature, top-p, seed) as if the drafted tokens before
it had been decoded, accept the drafted token while it equals the draw, and emit the first draw
that differs (or the draw after the last drafted token). The emitted tokens are then exactly
the draws a non-speculative decode makes: greedy replies are those of decoding one token at a
time, sampled ones follow the same distribution, and a seeded request draws the same tokens
(its key advances once per emitted token: `rewind`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.inpass import tap
from prefixd.backends.mlx.engine.inpass.captured import Captured, RowOf
from prefixd.backends.mlx.engine.spec.company import Offer
from prefixd.backends.mlx.engine.spec.config import SpecConfig
from prefixd.backends.mlx.engine.spec.draft import Pace
from prefixd.backends.mlx.engine.spec.drafter import Context, Drafter
from prefixd.backends.mlx.engine.spec.draftmodel import ModelDrafter
from prefixd.backends.mlx.engine.spec.lookup import PromptLookup
from prefixd.backends.mlx.engine.spec.mtpdraft import MTPDrafter
from prefixd.backends.mlx.engine.spec.row import Row, argmax_rows

log = logging.getLogger("prefixd.worker.cache")


class Speculation:
    """One run's drafting state: its lookup over prompt and reply, its pace, what it drafted
    and accepted, and the states at each position of its last verify pass (`captured`, until
    the tokens it accepted are all yielded: a reply that ends among them goes back to its
    end)."""

    def __init__(self, config: SpecConfig, prompt: list[int], max_tokens: int) -> None:
        self.config = config
        self.lookup = PromptLookup(prompt, max_tokens + config.max_draft + 1, config.ngram)
        self.pace = Pace(config.max_draft, config.costs)
        # where the context has nothing to copy: the model's own head, else a draft model
        self.model: Drafter | None = \
            MTPDrafter(config.mtp) if config.mtp is not None else \
            ModelDrafter(config.draft_model) if config.draft_model is not None else None
        self.model_pace = Pace(config.max_draft, config.draft_costs or config.costs,
                               standing=config.standing)
        self.source = self.pace   # whose draft was verified last
        self.drafted = self.accepted = self.passes = self.model_drafted = 0
        self.model_accepted = 0
        self.captured: Captured | RowOf | None = None
        self.held = 0   # positions of the last verify pass in the live cache
        self.reach = 0  # how far back the last draft's match reached

    def draft(self, run: Row, token: int, room: int) -> list[int]:
        """The draft to verify after `token` alone (at most `room` tokens; empty: decode one):
        a copy from the context where there is one that pays, else the model drafter's."""
        limit = min(room, self.config.max_draft)
        context = Context(run.prompt, run.fed, token)
        tokens = self.lookup.propose(context, limit)
        self.reach = self.lookup.reach
        self.source = self.pace
        k = self.pace.length(self.reach) if tokens else 0
        return tokens[:k] if k else self._model_draft(context, limit, 1)

    def _model_draft(self, context: Context, limit: int, rows: int) -> list[int]:
        """Its model drafter's draft (a draft model's, or the MTP head's) sized by its own pace
        in a pass of `rows` requests: empty where it has none, or where it cannot pay."""
        costs = self.config.draft_costs
        if self.model is None or costs is None or not costs.pays(limit):
            return []
        k = min(self.model_pace.length(Pace.MODEL, rows), limit)
        if not k:
            return []
        self.source, self.reach = self.model_pace, Pace.MODEL
        out = self.model.propose(context, k)
        costs.observe(self.model.passes, self.model.seconds)
        return out

    def offer(self, run: Row, token: int, room: int, rows: int) -> Offer | None:
        """What it would verify after `token` in a decode batch's pass of `rows` (at most
        `room` tokens), for the batch to size the pass (`company.width`): a copy from the
        context while its pace lets it draft, else its model drafter's draft where that pays
        (sized by its own pace: its passes cost whatever the batch decides)."""
        limit = min(room, self.config.max_draft)
        if limit <= 0:
            return None
        context = Context(run.prompt, run.fed, token)
        tokens = self.lookup.propose(context, limit)
        got = self.pace.offer(self.lookup.reach) if tokens else None
        if got is not None:
            self.source, self.reach = self.pace, self.lookup.reach
            return Offer(tokens, *got)
        out = self._model_draft(context, limit, rows)
        return Offer(out, self.model_pace.alpha(Pace.MODEL)) if out else None

    def peek(self, run: Row, token: int, room: int) -> Offer | None:
        """What `offer` after `token` would offer from the context, asked without changing its
        pace (a batch deciding whether to launch its next pass asks: `engine/batch/launch.py`);
        a model drafter's draft is not known before it runs (`model` is then asked)."""
        limit = min(room, self.config.max_draft)
        if limit <= 0:
            return None
        # the length `offer` asks for at that step: its proposal is then this one, kept
        tokens = self.lookup.propose(Context(run.prompt, run.fed, token), limit)
        got = self.pace.peek(self.lookup.reach) if tokens else None
        return Offer(tokens, *got) if got is not None else None

    def declined(self) -> None:
        """The draft it offered was not verified: its batch's pass did not pay for it."""
        self.source.decline(self.reach)

    def verify(self, run: Row, token: int, draft: list[int]) -> list[int]:
        """Feed `token` and `draft` in one pass: the tokens the run yields from here (the
        accepted drafted ones, then the first draw that differs from the draft or the draw
        after it), with the cache (and `run.fed`) holding `token` and the accepted ones."""
        t0 = time.perf_counter()   # all of it: a pass, its captures, going back
        start = run.pos + len(run.fed)
        x = [token, *draft]
        n = len(x)
        leaves = self.config.leaves
        before = snapshot.take(run.cache, leaves)[0] if leaves else {}
        recorder = tap.Tap(tuple(range(1, n)), n, self.config.replays(run.cache, n)) \
            if leaves else None
        run.broken = True
        with tap.tapping(recorder):
            logits = run.model(mx.array(x)[None], cache=run.cache)[0]
        captured = recorder.capture(run.cache, leaves) if recorder else None
        hidden = self.config.taken()
        draws = self.draws(run, x, logits)
        snapshot.evaluate(run.cache, logits, *draws, *(captured.arrays() if captured else ()))
        run.broken = False
        a, emitted = self.accept(run, x, draws, alone=True)
        if recorder is not None and recorder.failed and a + 1 < n:
            self._refeed(run, before, x[:a + 1], n)
            hidden = self.config.taken()
        else:
            self.captured, self.held = captured, n
            self.go_back(run, a + 1)
        self.saw(start, hidden, 0, a + 1)
        self.config.costs.observe(n, time.perf_counter() - t0)
        return emitted

    @staticmethod
    def draws(run: Row, x: list[int], logits: mx.array) -> list[mx.array]:
        """The run's draw at each position of `x` (lazy; `logits`: [len(x), vocab]), its
        processors seeing the tokens of `x` before it as decoded; a `plain` run's in one array
        of them all (`argmax_rows`)."""
        if run.plain:
            return [argmax_rows(logits[:len(x)])]
        history = run.prompt + run.fed
        return [run.draw(logits[i:i + 1], history + x[:i + 1]) for i in range(len(x))]

    def accept(self, run: Row, x: list[int], draws: list[mx.array],
               alone: bool = False) -> tuple[int, list[int]]:
        """The drafted tokens of `x` (after its first) that equal the draws (evaluated):
        how many, and the tokens the run yields (those, then the first draw that differs or
        the one after them); the sampler's unused draws undone, the counts and pace updated,
        `x`'s first token and the accepted ones appended to `run.fed`."""
        draft = x[1:]
        got = cast(list[int], mx.concatenate([d.reshape(-1) for d in draws]).tolist())
        a = 0
        while a < len(draft) and got[a] == draft[a]:
            a += 1
        _rewind(run.sampler, len(x) - (a + 1))
        for proc in run.processors:      # a grammar's matcher (the others keep no state)
            _rewind(proc, len(x) - (a + 1))
        self.drafted, self.accepted, self.passes = (self.drafted + len(draft),
                                                    self.accepted + a, self.passes + 1)
        self.source.update(self.reach, len(draft), a, alone)
        if self.source is self.model_pace:   # counted once verified (a batch may cut it)
            self.model_drafted += len(draft)
            self.model_accepted += a
        run.fed.extend(x[:a + 1])
        return a, [*draft[:a], got[a]]

    def go_back(self, run: Row, keep: int) -> bool:
        """Keep the first `keep` positions of the last verify pass in the live cache: full
        attention trimmed, the other leaves replaced by their state there (captured in the
        pass), or, for a wrapped window the pass left whole (a batch's row: a batch does not
        capture windows), cut back from the positions it holds (`snapshot.window_goes_back`).
        False when it cannot (the cache is as it was)."""
        drop = self.held - keep
        if drop <= 0:
            return True
        if keep < 1:
            return False
        leaves = snapshot.leaves(run.cache)
        captured = self.captured.get(keep) if self.captured is not None else {}
        cut = [i for i in self.config.leaves if i not in captured]
        if not all(snapshot.window_goes_back(leaves[i], drop) for i in cut):
            return False
        new = []
        for i, leaf in enumerate(leaves):
            if i in captured:
                new.append(snapshot.copy_leaf(captured[i]))
            elif i in cut:
                snapshot.window_back(leaf, drop)
                new.append(leaf)
            else:
                leaf.trim(drop)
                new.append(leaf)
        run.cache = snapshot.rebuild(run.cache, new)
        self.held = keep
        return True

    def _refeed(self, run: Row, before: snapshot.Snapshot, kept: list[int], n: int) -> None:
        """The tap failed: the snapshotted leaves back to their state before the pass, the
        KV trimmed to it, and the kept tokens fed again."""
        run.cache = snapshot.rewound(run.cache, before, n)
        run.broken = True
        run.model(mx.array(kept)[None], cache=run.cache)
        snapshot.evaluate(run.cache)
        run.broken = False
        self.captured, self.held = None, 0

    def saw(self, start: int, hidden: mx.array | None, row: int, n: int) -> None:
        """The served model's hidden states at positions start..start + n of this request (row
        `row` of the pass that just ran: `SpecConfig.taken`): what an MTP head drafts from."""
        if self.model is not None:
            self.model.saw(start, hidden, row, n)

    @property
    def kind(self) -> str:
        """Who wrote its last draft: "lookup", "mtp" (the model's head) or "model" (a draft
        model)."""
        if self.source is not self.model_pace:
            return "lookup"
        return self.model.kind if self.model is not None else "model"

    def went_back_by(self) -> str:
        """How its last verify pass captured the states to go back (`PassCounts.verify`)."""
        if not self.config.leaves:
            return "none"
        return "recomputed" if self.captured is not None and self.captured.replayed else "kept"

    def release(self) -> None:
        """Its captured states and its draft model's cache let go (`Run.release`)."""
        self.captured = None
        if self.model is not None:
            self.model.reset()

    def info(self) -> dict[str, Any]:
        out = {"drafted": self.drafted, "accepted": self.accepted, "passes": self.passes}
        return out if self.model is None else {**out, "model_drafted": self.model_drafted,
                                               "model_accepted": self.model_accepted}


def _rewind(fn: Callable[..., mx.array], draws: int) -> None:
    """Undo a sampler's (or a logits processor's) last `draws` draws (a seeded sampler's key, a
    log-probability tap's record, a grammar's matcher): the drawn tokens after the first
    rejected one were never emitted."""
    rewind = getattr(fn, "rewind", None)
    if draws > 0 and rewind is not None:
        rewind(draws)
