"""Who is in a decode batch, and their caches going in and out of it: the part of the batch
executor (`executor.Batch`, a mixin of it) that owns the membership.

A run joins at its first batched step: its full-attention KV rows stacked with the batch's
into one new buffer with `GROWTH` spare positions (`stacking.stack`), other layers through
mlx-lm's `merge` and `extend`, a layer at a time, each run's layer dropped once copied (so a
join holds about the larger of the two, not both). It leaves when its request ends, is
cancelled, or steps alone again: `extract` gives back a cache of its own, exactly the classes
and contents it would hold alone, then `filter` drops its row. A copy of a row (`row`), of its
recurrent leaves (`states_of`) or of any leaves (`leaves_of`, a checkpoint) can be taken while
it stays. A failure leaves every member `broken` and the batch empty. Each of these first takes
back a pass launched ahead (`launch.py`): they see the caches the last step left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.batch import launch
from prefixd.backends.mlx.engine.batch.stacking import GROWTH, release, stack, stackable

if TYPE_CHECKING:
    from prefixd.backends.mlx.engine.batch.passes import PassCounts
    from prefixd.backends.mlx.engine.live.state import Live


class Members:
    """The batch's members and their merged caches (the Batch's state)."""

    runs: list[Live]
    cache: list[Any] | None
    passes: PassCounts
    launched: launch.Launched | None   # the next pass, launched ahead (`launch.py`)
    ahead: launch.Worth                # whether launching it pays

    def _settle(self) -> None:
        """A pass launched ahead taken back: the caches as the last step left them."""
        launched, self.launched = self.launched, None
        if launched is None or self.cache is None:
            return
        try:
            launch.undo(self.cache, launched)
        except BaseException:
            self._break()
            raise
        self.passes.launched(False)
        self.ahead.outcome(False)

    def _join(self, runs: list[Live]) -> None:
        """Merge the runs' caches into the batch a layer at a time, each run's layer dropped
        once copied: joining holds about the larger of the two (the runs' caches, the batch),
        not both. A failure leaves every member and joiner `broken`, and the batch empty."""
        if not runs:
            return
        self._settle()
        caches = [r.cache for r in runs]
        for r in runs:
            r.cache, r.batch = [], self
            self.runs.append(r)
        try:
            batch = self.cache = self.cache or [None] * len(caches[0])
            for i, kind in enumerate([type(layer) for layer in caches[0]]):
                mine, joining = batch[i], [c[i] for c in caches]
                if stackable(mine, joining):
                    batch[i] = stack(mine, joining)
                elif mine is None:
                    batch[i] = kind.merge(joining)
                else:
                    mine.extend(kind.merge(joining))
                snapshot.evaluate([batch[i]])
                for c in caches:
                    c[i] = None
                del mine, joining
        except BaseException:
            self._break()
            raise
        for leaf in snapshot.leaves(self.cache):
            if hasattr(leaf, "step"):   # grown for every row at once: in smaller steps
                leaf.step = GROWTH
        release()   # the copies merged from go back now, not at the allocators' leisure

    def _break(self) -> None:
        for r in self.runs:
            r.broken, r.batch = True, None
        self.runs, self.cache, self.launched = [], None, None

    def states_of(self, run: Live, kept: tuple[int, ...]) -> snapshot.Snapshot:
        """`run`'s row of the batch's recurrent and convolution leaves `kept`, in arrays of its
        own (the batch's are replaced at its next step): what a stop mark keeps."""
        self._settle()
        assert self.cache is not None
        i = self.runs.index(run)
        live = snapshot.leaves(self.cache)
        return {k: snapshot.own_row(live[k], i) for k in kept}

    def leaves_of(self, run: Live, kept: tuple[int, ...]) -> snapshot.Snapshot:
        """`run`'s row of the batch's leaves `kept`, each a cache of its own class alone (a
        recurrent or convolution leaf's row copied, a window's extracted): a checkpoint of the
        state its row holds now, as `snapshot.take` of its cache alone would be."""
        self._settle()
        assert self.cache is not None
        i = self.runs.index(run)
        live = snapshot.leaves(self.cache)
        try:
            out = {k: snapshot.own_row(live[k], i) if type(live[k]) is ArraysCache
                   else live[k].extract(i) for k in kept}
            snapshot.evaluate(list(out.values()))
        except BaseException:
            self._break()
            raise
        return out

    def row(self, run: Live) -> list[Any]:
        """A copy of `run`'s cache as the batch holds it (it stays a member)."""
        self._settle()
        assert self.cache is not None
        i = self.runs.index(run)
        try:
            mine = [layer.extract(i) for layer in self.cache]
            snapshot.evaluate(mine)
        except BaseException:
            self._break()
            raise
        return mine

    def leave(self, run: Live) -> None:
        """`run` takes its own cache back out of the batch (its row dropped), a layer at a
        time (the old layer freed before the next is copied)."""
        self._settle()
        assert self.cache is not None
        i = self.runs.index(run)
        rows = len(self.runs)
        keep = mx.array([j for j in range(rows) if j != i])
        mine: list[Any] = []
        try:
            for layer in self.cache:
                mine.append(layer.extract(i))
                if rows > 1:
                    layer.filter(keep)
                snapshot.evaluate([mine[-1], *([layer] if rows > 1 else [])])
        except BaseException:
            self._break()
            raise
        run.cache, run.batch = mine, None
        self.runs.pop(i)
        if not self.runs:
            self.cache = None
        release()
