"""A reply that a stop string ends, stored exactly up to it (`Stops`, the part of a run's live
state that keeps it; `engine/run.py`'s `Run` extends it).

Owns: the state kept before a token whose text may begin a stop string (`stop_mark`), and
going back to it when the stop string completes (`end_at_stop`). Why: the caller holds back
text that may be a stop string, and the reply it ends is stored as far as the next turn
repeats it; full attention trims back anyway, recurrent and convolution states need the state
before that token, kept where it is cheap.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import ArraysCache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.live.state import Live


class Stops(Live):
    """`Live`, and the state kept before a possible stop string."""

    def _forward(self, tokens: list[int], logits: bool = True,
                 offsets: tuple[int, ...] = ()) -> Any:
        """The model over `tokens` (`Run`'s)."""
        raise NotImplementedError

    def mark_stop(self) -> None:
        """The text from the token just yielded on may be a stop string (its caller holds it
        back): keep the state before that token, so a reply a stop string ends there is stored
        up to it (`end_at_stop`), as far as the next turn repeats it. Where full attention
        trims back to it anyway, and where it is cheap: a run whose other layers are recurrent
        or convolution states (arrays no step writes into: kept as they are alone, a copy of
        its row in a decode batch; a window's buffer would be copied at every step it is held,
        so a reply a stop string ends there stores its prompt, a miss it names)."""
        self.stop_mark = None
        i = self.sampled - 1      # the token's place in the reply
        if self.broken or i < 0:
            return
        batch = self.batch
        live = snapshot.leaves(self.cache if batch is None else batch.cache or [])
        kept = tuple(k for k, leaf in enumerate(live) if not snapshot.trims(leaf))
        if not live or any(type(live[k]) is not ArraysCache for k in kept):
            return
        if i == len(self.fed):    # the token is pending: the live cache is before it
            self.stop_mark = i, snapshot.take(self.cache, kept)[0] if batch is None else \
                batch.states_of(self, kept)
        elif self.spec is not None and self.spec.captured is not None:
            # accepted in the last verify pass (in the cache): the state captured before it
            snap = self.spec.captured.get(i - (len(self.fed) - self.spec.held))
            if all(k in snap for k in kept):
                self.stop_mark = i, {k: snap[k] if batch is None else snapshot.own_row(snap[k])
                                     for k in kept}

    def end_at_stop(self, at: int) -> None:
        """The reply ended with a stop string whose text begins in its token `at`: the cache
        holds the reply before that token, and nothing more is fed. Trimmed where every layer
        trims; else back to the mark (at or before `at`: the state there was kept) and the
        tokens from the mark to `at` fed again, in one pass (out of its decode batch first).
        Without a mark, `feed_pending` as ever (the reply and its stop string stored)."""
        if self.stop_mark is None or self.broken \
                or not self.stop_mark[0] <= at <= len(self.fed):
            return
        self.settle()
        i, snap = self.stop_mark if self.stop_mark[1] else (at, {})
        again = self.fed[i:at]
        if i < len(self.fed):
            self.cache = snapshot.rewound(self.cache, snap, len(self.fed) - i)
            del self.fed[i:]
        self.ahead, self.pending, self.stop_mark = [], None, None
        if again:
            self._forward(again, logits=False)
            self.batched += len(again)
            self.fed.extend(again)
