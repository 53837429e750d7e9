"""Drafting for speculative decoding: what to propose and how much, pure (numpy, no mlx).

Owns: `PromptLookup`, the drafter that needs no second model: the reply's last few tokens
looked up in the request's own context (prompt and reply so far), and the tokens that followed
their latest earlier occurrence proposed as the continuation (an edit's `old_string`, a file
rewritten with one change, a path echoed from a tool result are copies of the context);
`Pace`, the per-request policy that sizes each draft from the acceptance seen so far and what
a pass of each length costs, and drafts nothing when drafting does not pay; and `PassCosts`,
what a decode pass of each length costs (measured as the worker runs, or a fixed shape where
decisions may not depend on time: a group's ranks).

Why the decision is per request and adaptive: one request copies (edits, tool calls echoing
paths) and another writes prose; a draft that is rejected costs a pass longer than one token,
so a request whose drafts are rejected stops drafting, and tries again now and then (its reply
may reach a part that copies).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class PromptLookup:
    """The request's tokens so far (prompt, then each token it generates) and the n-gram
    lookup over them. `ngram`: the longest suffix looked up (then shorter ones, down to
    `min_ngram`)."""

    def __init__(self, prompt: list[int], capacity: int, ngram: int = 4,
                 min_ngram: int = 2) -> None:
        self.buf = np.zeros(max(len(prompt) + capacity, 16), dtype=np.int64)
        self.buf[:len(prompt)] = prompt
        self.n = len(prompt)
        self.ngram, self.min_ngram = max(1, ngram), max(1, min(min_ngram, ngram))

    def extend(self, tokens: list[int]) -> None:
        need = self.n + len(tokens)
        if need > len(self.buf):
            self.buf = np.concatenate([self.buf, np.zeros(need, dtype=np.int64)])
        self.buf[self.n:need] = tokens
        self.n = need

    def propose(self, k: int) -> tuple[list[int], int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
        (`ngram` .. `min_ngram` tokens) of the tokens so far, and the matched length (0: no
        match)."""
        if k <= 0:
            return [], 0
        seq = self.buf[:self.n]
        for size in range(min(self.ngram, self.n - 1), self.min_ngram - 1, -1):
            tail = seq[self.n - size:]
            # candidate starts: occurrences of the suffix that end before the suffix itself
            starts = np.flatnonzero(seq[:self.n - size] == tail[0])
            for j in range(1, size):
                if not starts.size:
                    break
                starts = starts[seq[starts + j] == tail[j]]
            if starts.size:
                at = int(starts[-1]) + size
                return seq[at:at + k].tolist(), size
        return [], 0


@dataclass
class PassCosts:
    """What a decode pass of `n` tokens costs, relative to one of 1 token: measured (an
    exponential average of the passes' own times, per length) on top of a prior shape (a
    CPU's: every extra token ~15% of a one-token pass). `timed` False: the prior only (a
    group's ranks decide alike)."""

    timed: bool = True
    seconds: dict[int, float] = field(default_factory=dict)
    PRIOR_SLOPE = 0.15
    WEIGHT = 0.2

    def observe(self, n: int, seconds: float) -> None:
        if not self.timed or seconds <= 0:
            return
        old = self.seconds.get(n)
        self.seconds[n] = seconds if old is None else old + self.WEIGHT * (seconds - old)

    def ratio(self, n: int) -> float:
        """cost(n) / cost(1), from measurements where both lengths have some, else the prior
        (and never below the cost of fewer tokens' passes: a pass does not get cheaper)."""
        one = self.seconds.get(1)
        if n <= 1:
            return 1.0
        if one and n in self.seconds:
            return max(1.0, self.seconds[n] / one)
        known = [(m, s / one) for m, s in self.seconds.items() if one and 1 < m < n]
        if known:   # the prior's slope from the longest measured length
            m, r = max(known)
            return max(1.0, r + self.PRIOR_SLOPE * (n - m))
        return 1.0 + self.PRIOR_SLOPE * (n - 1)


@dataclass
class Pace:
    """One request's draft sizing. The acceptance rate `alpha` (the chance that a drafted token
    is accepted given the ones before it were) is an exponentially weighted estimate over its
    verify passes; the next draft is the length k (at most `max_draft`) that maximizes the
    expected tokens per pass, (1 - alpha^(k+1)) / (1 - alpha), per its cost; 0 when no length
    beats a one-token pass by `MARGIN`. After a declined or failed draft it waits before trying
    again, twice as long each time (up to `MAX_WAIT` steps), so prose costs almost nothing."""

    max_draft: int
    costs: PassCosts
    accepted: float = 2.0     # a prior worth ~3 drafted tokens at 2/3 acceptance
    rejected: float = 1.0
    wait: int = 0             # decode steps to go before drafting again
    backoff: int = 1
    probe: bool = False       # the next length is a one-token probe if nothing pays
    DECAY = 0.85
    MARGIN = 1.02
    MAX_WAIT = 64

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def length(self) -> int:
        """The draft length to verify at this step (0: decode one token)."""
        if self.max_draft <= 0:
            return 0
        if self.wait > 0:
            self.wait -= 1
            return 0
        a = min(self.alpha, 0.99)
        best, best_k = self.MARGIN, 0
        for k in range(1, self.max_draft + 1):
            gain = (1 - a ** (k + 1)) / (1 - a) / self.costs.ratio(k + 1)
            if gain > best:
                best, best_k = gain, k
        if best_k:
            return best_k
        if self.probe:      # it waited: one token, to see whether drafting pays again
            self.probe = False
            return 1
        self._back_off()
        return 0

    def _back_off(self) -> None:
        self.wait, self.probe = self.backoff, True
        self.backoff = min(self.backoff * 2, self.MAX_WAIT)

    def update(self, drafted: int, accepted: int) -> None:
        """A verify pass checked `drafted` tokens and accepted the first `accepted`."""
        if drafted <= 0:
            return
        self.accepted = self.accepted * self.DECAY + accepted
        self.rejected = self.rejected * self.DECAY + (1 if accepted < drafted else 0)
        if accepted == 0:
            self._back_off()
        else:
            self.backoff = 1
