"""Prompt lookup: the drafter that needs no second model (`PromptLookup`, a `Drafter`).

The reply's last few tokens are looked up in the request's own context (prompt and reply so
far), and the tokens that followed their earlier occurrence are proposed as the continuation:
an edit's `old_string`, a file rewritten with one change, a path echoed from a tool result are
copies of the context. Pure (numpy, no mlx arrays).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import mlx.core as mx


class PromptLookup:
    """The request's tokens so far (prompt, then each token it generates) and the lookup over
    them. `ngram`: the fewest tokens a match must have (the last `ngram` tokens looked up)."""

    kind = "lookup"
    passes, seconds = 0, 0.0   # it runs no forward pass

    def __init__(self, prompt: list[int], capacity: int, ngram: int = 2) -> None:
        self.reach = 0   # how many tokens its last proposal's match covers (0: none)
        self.buf = np.zeros(max(len(prompt) + capacity, 16), dtype=np.int64)
        self.buf[:len(prompt)] = prompt
        self.n = len(prompt)
        self.min_ngram = max(1, ngram)
        # its last proposal: (tokens held, k, proposal, reach), asked again for the same
        # context (a batch launching ahead asks before the step that offers: `peek`)
        self._last: tuple[int, int, list[int], int] | None = None

    def extend(self, tokens: Sequence[int]) -> None:
        need = self.n + len(tokens)
        if need > len(self.buf):
            self.buf = np.concatenate([self.buf, np.zeros(need, dtype=np.int64)])
        self.buf[self.n:need] = tokens
        self.n = need

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed an earlier occurrence of `context`'s last tokens
        (the context is the request's: only what it adds to the tokens seen so far is read);
        `reach`: how many tokens that occurrence matches (0: none)."""
        if len(context) > self.n:
            self.extend(context[self.n:])
        last = self._last
        if last is not None and last[0] == self.n and last[1] >= k:
            self.reach = last[3]
            return last[2][:k]     # a vote's first k tokens do not depend on the ones after
        out, self.reach = self._propose(k)
        self._last = (self.n, k, out, self.reach)
        return out

    def saw(self, start: int, hidden: mx.array | None, row: int = 0, n: int = -1) -> None:
        """It reads tokens only."""

    def reset(self) -> None:
        """It holds the request's tokens only (let go with it)."""

    def _propose(self, k: int) -> tuple[list[int], int]:
        """Up to `k` tokens that followed earlier occurrences of the tokens so far, and how far
        back the best of them matches (0: none). Occurrences of the last `min_ngram` tokens are
        candidates, each weighted by the cube of how far back its match reaches (up to
        `REACH` tokens: the same line of the same file counts far more than another line that
        ends alike); the draft is the weighted majority's continuation, token by token among
        the candidates that agree so far (a loop the reply fell into, or a line the context
        holds several times, is followed where most of its earlier occurrences went, not where
        the latest one happened to); the latest occurrence wins a tie."""
        if k <= 0 or self.n <= self.min_ngram:
            return [], 0
        seq, n = self.buf[:self.n], self.n
        size = self.min_ngram
        starts = np.flatnonzero(seq[:n - size] == seq[n - size])
        for j in range(1, size):
            starts = starts[seq[starts + j] == seq[n - size + j]]
        if not starts.size:
            return [], 0
        # extend each candidate's match backwards, one token at a time, while any still grows
        reach = np.full(starts.shape, size)
        alive = np.ones(starts.shape, dtype=bool)
        for back in range(1, self.REACH - size + 1):
            at = starts - back
            grow = alive & (at >= 0)
            grow[grow] = seq[at[grow]] == seq[n - size - back]
            if not grow.any():
                break
            reach[grow] += 1
            alive = grow
        return self._vote(starts + size, reach, k), int(reach.max())

    def _vote(self, src: np.ndarray, reach: np.ndarray, k: int) -> list[int]:
        """The weighted majority's continuation of the candidates starting at `src`; a
        candidate that runs into the end goes on copying its own copy (a loop goes round)."""
        seq, n = self.buf[:self.n], self.n
        ahead = np.empty((src.size, k), dtype=np.int64)
        for p in range(k):
            at = src + p
            inside = at < n
            ahead[inside, p] = seq[at[inside]]
            wrap = ~inside
            ahead[wrap, p] = ahead[wrap, p - (n - src[wrap])]
        weight = reach.astype(np.float64) ** 3 * (1 + 1e-9 * np.arange(src.size))
        out: list[int] = []
        agree = np.ones(src.size, dtype=bool)
        for p in range(k):
            tokens, inverse = np.unique(ahead[agree, p], return_inverse=True)
            tally = np.bincount(inverse, weights=weight[agree])
            token = int(tokens[int(tally.argmax())])
            out.append(token)
            agree &= ahead[:, p] == token
        return out

    REACH = 64
