"""How much to draft for speculative decoding, and when it pays: pure (no mlx).

Owns: `Pace`, the per-request policy that sizes each draft from the acceptance seen so far and what
a pass of each length costs, and drafts nothing when drafting does not pay; and `PassCosts`,
what a decode pass of each length costs (measured as the worker runs, or a fixed shape where
decisions may not depend on time: a group's ranks).

Why the decision is per request and adaptive: one request copies (edits, tool calls echoing
paths) and another writes prose; a draft that is rejected costs a pass longer than one token,
so a request whose drafts are rejected stops drafting, and tries again now and then (its reply
may reach a part that copies). A model drafter (the served model's MTP head, a draft model)
that keeps missing waits longer between its probes (to `Pace.MODEL_MAX_WAIT` tokens), and its
standing carries from one request to the next (`Standing`): where it never guesses right it
costs about nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class PassCosts:
    """What a decode pass of `n` tokens costs, relative to one of 1 token: measured (an
    exponential average of the passes' own times, per shape) on top of a prior shape (a
    CPU's: every extra token ~15% of a one-token pass). A request's own passes are kept by
    length (`seconds`); a decode batch's by its rows and its tokens (`shaped`: rows x width,
    the work a pass does grows with both), for a pass of 8 tokens is not one cost: one
    request verifying 7 drafted tokens, 4 rows verifying one each and 8 rows stepping are
    measured apart (on 2 CPU cores, the built-in model: one request's pass of 5 tokens 73 ms,
    4 rows x 2 110 ms, 8 rows x 1 120 ms). `timed` False: the prior only (a group's ranks
    decide alike)."""

    timed: bool = True
    seconds: dict[int, float] = field(default_factory=dict)
    shaped: dict[tuple[int, int], float] = field(default_factory=dict)
    PRIOR_SLOPE = 0.15
    WEIGHT = 0.2

    def observe(self, n: int, seconds: float, rows: int = 1) -> None:
        if not self.timed or seconds <= 0:
            return
        table: dict[Any, float] = self.seconds if rows <= 1 else self.shaped
        key = n if rows <= 1 else (rows, n)
        old = table.get(key)
        table[key] = seconds if old is None else old + self.WEIGHT * (seconds - old)

    def one(self) -> float | None:
        """Seconds of a one-token pass: measured, else estimated from the shortest length
        measured (through the prior shape); None before any measurement."""
        if 1 in self.seconds:
            return self.seconds[1]
        if not self.seconds:
            return None
        m = min(self.seconds)
        return self.seconds[m] / (1 + self.PRIOR_SLOPE * (m - 1))

    def ratio(self, n: int, rows: int = 1) -> float:
        """cost(n) / cost(1) of a pass of `rows` requests (a batch's: measured against its
        plain step, which is `rows` tokens as a request's own passes measure them), else of
        one request's passes: from measurements where both lengths have some (or `one`'s
        estimate), else the prior (and never below the cost of fewer tokens' passes: a pass
        does not get cheaper)."""
        plain = self.shaped.get((rows, rows)) if rows > 1 else None
        if plain is None or n < rows:
            return self._alone(n, hopeful=rows <= 1)
        m = max(k for (r, k) in self.shaped if r == rows and k <= n)
        return max(1.0, self._alone(rows) * self.shaped[(rows, m)] / plain +
                   self.PRIOR_SLOPE * (n - m))

    def _alone(self, n: int, hopeful: bool = False) -> float:
        """`hopeful`: a request's own pass longer than any measured is priced as the longest
        measured (it is tried, then measured): on a CPU a pass of 16 tokens costs less than
        one of 12 (the built-in model: 2.0x a one-token pass against 2.7x), which the prior's
        slope from 8 would price at 3.0x and never try."""
        one = self.one()
        if n <= 1:
            return 1.0
        if one and n in self.seconds:
            return max(1.0, self.seconds[n] / one)
        known = [(m, s / one) for m, s in self.seconds.items() if one and 1 < m < n]
        if known:   # the prior's slope from the longest measured length (hopeful: flat)
            m, r = max(known)
            return max(1.0, r + (0.0 if hopeful else self.PRIOR_SLOPE * (n - m)))
        return 1.0 + self.PRIOR_SLOPE * (n - 1)


@dataclass
class Rate:
    """The acceptance of one kind of draft (`Pace.BUCKETS`): the chance `alpha` that a drafted
    token is accepted given the ones before it were, an exponentially weighted estimate over
    its verify passes from a prior, and how long it waits before drafting again after a draft
    that failed or did not pay (twice as long each time, up to `cap` steps; back to one once a
    draft of it is accepted, but for a probe after a decline, `Pace.decline`)."""

    accepted: float
    rejected: float
    wait: int = 0
    backoff: int = 1
    probe: bool = False       # the next length is a one-token probe if nothing pays
    probing: bool = False     # the draft verified last was that probe
    declined: bool = False    # its wait follows its batch declining a draft (its cost)
    cap: int = 64             # `Pace.MAX_WAIT`, a model's drafts' `Pace.MODEL_MAX_WAIT`

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def back_off(self) -> None:
        self.wait, self.probe = self.backoff, True
        self.backoff = min(self.backoff * 2, self.cap)


@dataclass
class Standing:
    """The worker's last word on its model drafter's drafts (its MTP head's or its draft
    model's `Rate`): each request's pace starts from it and leaves its own there, so a head
    that keeps missing stays backed off from one request to the next (a probe every
    `Pace.MODEL_MAX_WAIT` tokens at most) instead of each request trying it afresh (a long
    draft on the prior, then a probe after 1, 2, 4, ... tokens: about 7 in 200), and one that
    starts being accepted drafts again from its next probe on. Decided by acceptance alone:
    the same on a group's ranks."""

    rate: Rate | None = None


@dataclass
class Pace:
    """One request's draft sizing, by how far back the drafter's match reaches (a copy of a
    whole line is more likely to go on than two tokens that happen to recur): per reach, a
    `Rate`; the next draft is the length k (at most `max_draft`) that maximizes the expected
    tokens per pass, (1 - alpha^(k+1)) / (1 - alpha), over its cost; 0 when no length beats
    a one-token pass by `MARGIN`, then drafts of that reach wait (a one-token probe after the
    wait), so prose costs almost nothing."""

    max_draft: int
    costs: PassCosts | DraftCosts
    rates: dict[int, Rate] = field(default_factory=dict)
    standing: Standing | None = None   # the worker's, for the model drafter's rate
    # reach (tokens matched) -> its bucket's prior alpha, over ~3 drafted tokens
    BUCKETS = ((2, 0.35), (3, 0.45), (5, 0.6), (9, 0.7), (17, 0.8))
    DECAY = 0.85
    MARGIN = 1.02
    MAX_WAIT = 64

    MODEL = -1          # the reach of a draft model's drafts (`draftmodel.py`): its own rate
    MODEL_PRIOR = 0.6
    # a model drafter's wait grows further: each of its probes costs its passes too, and the
    # context (which a copy may reach any time) says nothing of when it starts to guess right
    MODEL_MAX_WAIT = 256

    def _rate(self, reach: int) -> Rate:
        if reach == self.MODEL:
            if self.MODEL not in self.rates:
                kept = self.standing.rate if self.standing is not None else None
                self.rates[self.MODEL] = replace(kept) if kept is not None else Rate(
                    3 * self.MODEL_PRIOR, 3 * (1 - self.MODEL_PRIOR), cap=self.MODEL_MAX_WAIT)
            return self.rates[self.MODEL]
        low, prior = max((b, p) for b, p in self.BUCKETS if b <= max(reach, 2))
        if low not in self.rates:
            self.rates[low] = Rate(3 * prior, 3 * (1 - prior), cap=self.MAX_WAIT)
        return self.rates[low]

    def _keep(self, reach: int) -> None:
        """The model drafter's rate left where the worker's next requests start from."""
        if reach == self.MODEL and self.standing is not None:
            self.standing.rate = replace(self.rates[self.MODEL])

    def length(self, reach: int, rows: int = 1) -> int:
        """The draft length to verify at this step for a match of `reach` tokens (0: decode
        one token), in a pass of `rows` requests (a decode batch's: a draft of k makes it a
        pass of rows x (k + 1) tokens against rows, and the other members, one token each,
        pay for it too: the length is the one that maximizes the tokens the whole pass emits
        over its cost)."""
        k = self._length(reach, rows)
        self._keep(reach)
        return k

    def _length(self, reach: int, rows: int) -> int:
        rate = self._rate(reach)
        if self.max_draft <= 0:
            return 0
        if rate.wait > 0:
            rate.wait -= 1
            return 0
        a = min(rate.alpha, 0.99)
        best, best_k = self.MARGIN, 0
        base = self.costs.ratio(rows, rows)
        for k in range(1, self.max_draft + 1):
            emitted = (rows - 1 + (1 - a ** (k + 1)) / (1 - a)) / rows
            gain = emitted * base / self.costs.ratio(rows * (k + 1), rows)
            if gain > best:
                best, best_k = gain, k
        if best_k:
            return best_k
        if rate.probe:      # it waited: one token, to see whether drafting pays again
            rate.probe = False
            return 1
        rate.back_off()
        return 0

    def alpha(self, reach: int) -> float:
        """The acceptance estimate of a match of `reach` tokens (`MODEL`: the model's)."""
        return self._rate(reach).alpha

    def offer(self, reach: int) -> tuple[float, bool] | None:
        """For a decode batch's joint width (`company.width`): the acceptance estimate of a
        match of `reach` tokens, and whether this is a probe after a wait (its pass then
        verifies at least one drafted token, paying or not, to learn); None while drafts of
        that reach wait. What pays is decided for the whole pass there; a draft the batch
        did not verify is `declined`."""
        got, rate = self.peek(reach), self._rate(reach)
        if got is None:
            rate.wait = max(rate.wait - 1, 0)
        else:
            rate.probe, rate.probing = False, got[1]
        return got

    def peek(self, reach: int) -> tuple[float, bool] | None:
        """What `offer` would offer for that reach now, asked without changing the pace (a
        batch deciding whether to launch its next pass before the step that offers)."""
        rate = self._rate(reach)
        if self.max_draft <= 0 or rate.wait > 0:
            return None
        return rate.alpha, rate.probe

    def decline(self, reach: int) -> None:
        """An offered draft of that reach did not pay in its batch's pass: drafts of it wait
        (doubling), then probe, as a draft that does not pay alone (`length`); that probe
        accepted does not shorten the next wait (the batch's cost declined it, not its
        acceptance)."""
        (rate := self._rate(reach)).back_off()
        rate.declined = True
        self._keep(reach)

    def update(self, reach: int, drafted: int, accepted: int, alone: bool = False) -> None:
        """A verify pass checked `drafted` tokens (matched over `reach`) and accepted the
        first `accepted`. None accepted: drafts of that kind wait, but for a copy verified
        by a request alone (`alone`): the rejection lowers its acceptance, which sizes its
        next draft, and where no length pays it waits then (`length`); a copy rejected at a
        line break goes on after it (on the built-in model's patch-shaped replies, offline:
        1.77x to 1.90x)."""
        if drafted <= 0:
            return
        rate = self._rate(reach)
        rate.accepted = rate.accepted * self.DECAY + accepted
        rate.rejected = rate.rejected * self.DECAY + (1 if accepted < drafted else 0)
        if accepted == 0 and (not alone or reach == self.MODEL):
            rate.back_off()
            rate.declined = False
        elif accepted and not (rate.probing and rate.declined):
            rate.backoff, rate.declined = 1, False   # (a probe after a decline keeps its wait)
        rate.probing = False
        self._keep(reach)


# How much slower a decode batch member that drafts nothing may step because another's draft
# widens the pass (against a plain step of the batch): the issue-35 bound on a request's time
# per token in company.
FAIR = 1.5


def fair_width(costs: PassCosts | DraftCosts, rows: int, widest: int) -> int:
    """The widest verify pass (positions per row, at most `widest`) of a decode batch of
    `rows` in which some member drafts nothing: its step then costs at most `FAIR` times a
    plain step of the batch, so a member writing prose beside one copying a file keeps at
    least 1 / FAIR of its decode rate (1: no drafts in this pass)."""
    base = costs.ratio(rows, rows)
    width = 1
    while width < widest and costs.ratio(rows * (width + 1), rows) <= FAIR * base:
        width += 1
    return width


@dataclass
class DraftCosts:
    """What a verify pass of `n` tokens costs when a draft model wrote its `n - 1` drafted
    tokens: the pass (`base`) and the draft model's passes, one per drafted token (measured
    against a one-token pass of the served model; a prior of a tenth of one)."""

    base: PassCosts
    seconds: float | None = None   # one draft-model pass (exponential average)
    PRIOR = 0.1

    def observe(self, passes: int, seconds: float) -> None:
        if not self.base.timed or passes <= 0 or seconds <= 0:
            return
        each = seconds / passes
        self.seconds = each if self.seconds is None else \
            self.seconds + PassCosts.WEIGHT * (each - self.seconds)

    def pays(self, most: int) -> bool:
        """Whether a draft of at most `most` tokens could pay even if all were accepted: a
        draft model about as slow as the served one never does (it is then not asked)."""
        return any((k + 1) / self.ratio(k + 1) > Pace.MARGIN for k in range(1, most + 1))

    def ratio(self, n: int, rows: int = 1) -> float:
        one = self.base.one()
        share = self.seconds / one if self.seconds is not None and one else self.PRIOR
        return self.base.ratio(n, rows) + (n - 1) * share
