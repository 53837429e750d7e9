"""Drafts from the served model's own multi-token-prediction head (`model/mtp.py`), for
speculative decoding (`speculate.py`): where the context has nothing to copy, the head guesses
the next tokens from the model's last hidden state, one small pass a token.

Owns: the model's last hidden states as its passes leave them (`watch`: the final norm keeps its
output of the pass that just ran, `MTP.taken` hands it over once), and one request's head state
(`MTPDrafter`): the hidden states its passes left at each position (`saw`), the head's own KV
cache over the pairs (hidden state at i, token i + 1) it has been fed, and its guesses past
them, trimmed before the next draft. The head attends over what it was fed since the request's
last prefill pass (its hidden states are all the head ever sees of the prompt; a prompt restored
from the cache gives it only its last pass): a draft is only a guess, the verify pass decides,
so the reply is the served model's whatever the head proposes, and what it saw only changes how
often it is right.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from prefixd.backends.mlx.model.mtp import MTPHead, Parts


class _Watched(nn.RMSNorm):
    """A final norm that keeps its output (the hidden state the output projection reads) of
    the pass that ran last, until it is taken (`MTP.taken`). One model's passes run on one
    thread at a time (the worker's generation thread), so the slot is the model's own."""

    def __call__(self, x: mx.array) -> mx.array:
        out = super().__call__(x)
        object.__setattr__(self, "_kept", out)   # beside the module's parameters, not one
        return out

    def take(self) -> mx.array | None:
        out: mx.array | None = self.__dict__.pop("_kept", None)
        return out


def watch(parts: Parts) -> None:
    """Keep the model's final hidden states from now on (its final norm's class swapped: its
    weights and names stay as they are)."""
    norm = parts.inner.norm
    if type(norm) is nn.RMSNorm:
        norm.__class__ = _Watched
    elif not isinstance(norm, _Watched):
        raise ValueError(f"its final norm is a {type(norm).__name__}, not an RMSNorm")


class MTP:
    """A loaded head and the model parts it shares (one per worker)."""

    def __init__(self, head: MTPHead, parts: Parts) -> None:
        self.head, self.parts = head, parts

    def watch(self) -> None:
        """Keep the model's hidden states from now on (once speculation uses the head)."""
        watch(self.parts)

    def taken(self) -> mx.array | None:
        """The hidden states ([rows, positions, hidden]) of the model's last pass, handed over
        once (None: no pass since the last taken, or not watched)."""
        norm = self.parts.inner.norm
        return norm.take() if isinstance(norm, _Watched) else None


class MTPDrafter:
    """One request's MTP head state. `next`: the first position whose pair the head has not
    been fed; `guessed`: positions its cache holds past it (its last draft's guesses)."""

    kind = "mtp"
    HELD = 2048   # hidden states kept between drafts (a request not drafting for long)

    def __init__(self, mtp: MTP) -> None:
        self.mtp = mtp
        self.cache = KVCache()
        self.next = 0
        self.guessed = 0
        self.rows: list[_Seen] = []   # the hidden states it saw, by position
        self.held = 0   # positions from the first row's on
        self.passes, self.seconds = 0, 0.0   # of its last draft

    def saw(self, start: int, hidden: mx.array | None, row: int = 0, n: int = -1) -> None:
        """The served model's hidden states at positions start..start + n (`hidden`: a pass's
        [rows, positions, H], of which row `row`'s first `n`, all with -1; kept as they are,
        cut only when drafted from): what the request's cache holds there now, so an earlier
        pass's states from `start` on are replaced. At most `HELD` positions are kept for the
        next draft (the head restarts after what it lost)."""
        n = hidden.shape[1] if hidden is not None and n < 0 else n
        if hidden is None or n <= 0:
            return
        while self.rows and self.rows[-1].start >= start:
            self.rows.pop()
        if self.rows and self.rows[-1].end > start:
            last = self.rows[-1]
            self.rows[-1] = last._replace(n=start - last.start)
        self.rows.append(_Seen(start, hidden, row, n))
        while self.rows[-1].end - self.rows[0].start > self.HELD and len(self.rows) > 1:
            self.rows.pop(0)
        self.held = self.rows[-1].end - self.rows[0].start

    def _span(self, end: int) -> tuple[int, mx.array] | None:
        """From where to feed the head, and the hidden states there up to `end` (excluded):
        from the first position it has not been fed, or, across a gap in what it saw (or back
        before what it was fed), afresh from where the states it holds run unbroken."""
        first, chunks = end, []
        for seen in reversed(self.rows):
            if seen.start >= end:
                continue
            if seen.end < first:   # a gap before the states after it
                break
            chunks.append(seen.hidden[seen.row, :first - seen.start])
            first = seen.start
        if first >= end:
            return None
        hidden = chunks[0] if len(chunks) == 1 else mx.concatenate(chunks[::-1])
        if first <= self.next < end:
            return self.next, hidden[self.next - first:]
        self.cache, self.guessed = KVCache(), 0
        return first, hidden

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """`k` tokens the head guesses after `context` (the request's tokens, the one about to
        be fed last; the served model's hidden states seen up to the one before it)."""
        t0 = time.perf_counter()
        end = len(context) - 1
        span = self._span(end)
        if span is None:
            return []
        first, hidden = span
        if self.guessed:
            self.cache.trim(self.guessed)
            self.guessed = 0
        head, parts = self.mtp.head, self.mtp.parts
        out = head(hidden[None], parts.embed(mx.array(list(context[first + 1:end + 1]))[None]),
                   self.cache)
        self.next, self.rows, self.held = end, [], 0
        guesses: list[mx.array] = []
        while True:     # built whole, evaluated once: no sync per drafted token
            token = mx.argmax(parts.project(out[:, -1:, :]), axis=-1)
            guesses.append(token)
            if len(guesses) == k:
                break
            out = head(out[:, -1:, :], parts.embed(token), self.cache)
            self.guessed += 1
        drafted = cast(list[int], mx.concatenate(guesses, axis=1)[0].tolist())
        self.passes, self.seconds = k, time.perf_counter() - t0
        return drafted

    def reset(self) -> None:
        self.cache, self.rows, self.next, self.guessed, self.held = KVCache(), [], 0, 0, 0


class _Seen(NamedTuple):
    """Positions start..start + n: row `row` of a pass's hidden states ([rows, positions, H])."""

    start: int
    hidden: mx.array
    row: int
    n: int

    @property
    def end(self) -> int:
        return self.start + self.n
