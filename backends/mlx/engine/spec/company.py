"""Speculation in company: how wide a decode batch's verify pass is, decided for the whole
pass, and whether the batch drafts at all (`BatchPace`) (pure, no mlx).

A batch's verify pass costs what its rows x width tokens cost, every row padded to the
widest; so a draft sized for one request alone (`draft.Pace.length`: its own tokens against
its own pass) is the wrong question in company. Each member offers what it would draft (its
candidate tokens and the acceptance its pace estimates for them, `Offer`); the batch picks the
width W that maximizes the tokens the pass is expected to emit, summed over its rows, over
the pass's cost (`PassCosts.ratio(rows x W)`), against a plain step (one token a row); then
each row verifies its own candidate up to W - 1 tokens (a shorter one is padding anyway), and
accepts what it accepts (ragged: every row goes back to its own last accepted token,
`engine/batch/rows.py`), its pace updated by its own outcome. A member with nothing to offer
is slowed at most `draft.FAIR` (`draft.fair_width`), and pays for the pass's width for
nothing: such a pass must beat a plain step by `SHARED`, not `Pace.MARGIN` (measured on the
built-in model, four rows in prose: one row's one-token drafts, accepted 80% of the time,
gained the batch 3% of tokens a second and cost the other three 16% on each of those passes,
their time per token 3-5% over stock mlx-lm's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixd.backends.mlx.engine.spec.draft import Pace, PassCosts, fair_width

SHARED = 1.10   # what a verify pass must gain over a plain step where some member drafts nothing


@dataclass(frozen=True)
class Offer:
    """A batch member's candidate draft and the chance `alpha` that each of its tokens is
    accepted given the ones before it were."""

    tokens: list[int]
    alpha: float
    probe: bool = False   # it waited after drafts that did not pay: verified paying or not


def emitted(alpha: float, k: int) -> float:
    """The tokens a row emits in expectation from a draft of `k` tokens: its accepted run,
    then one drawn token, (1 - alpha^(k+1)) / (1 - alpha)."""
    a = min(max(alpha, 0.0), 0.99)
    return (1 - a ** (k + 1)) / (1 - a)


def width(offers: list[Offer | None], costs: PassCosts) -> int:
    """The positions per row of the batch's next pass (1: a plain step): the width whose
    expected tokens per unit cost beat a plain step's by `Pace.MARGIN`, the best of them; where
    some member offers nothing, by `SHARED` and at most `draft.fair_width`; at least 2 when a
    member probes (it learns whether its drafts pay again)."""
    rows = len(offers)
    longest = max((len(o.tokens) for o in offers if o is not None), default=0)
    if not longest:
        return 1
    idle = any(o is None or not o.tokens for o in offers)
    if idle:
        longest = min(longest, fair_width(costs, rows, longest + 1) - 1)
    base = rows / costs.ratio(rows, rows)
    best, best_w = base * (SHARED if idle else Pace.MARGIN), 1
    for w in range(2, longest + 2):
        tokens = sum(emitted(o.alpha, min(len(o.tokens), w - 1)) if o is not None else 1.0
                     for o in offers)
        gain = tokens / costs.ratio(rows * w, rows)
        if gain > best:
            best, best_w = gain, w
    if best_w == 1 and any(o is not None and o.probe and o.tokens for o in offers):
        return 2
    return best_w


@dataclass
class BatchPace:
    """Whether a decode batch's members draft at all: the tokens per second its verify passes
    emit against its plain steps', per batch size (exponential averages of the passes' own
    times, every cost in them: the pass, the draws at every position, each row going back).
    Verify passes that emit less per second than plain steps stop the batch drafting for a
    while (doubling to `MAX_WAIT` steps), then it tries again. Unmeasured passes (a group's, or
    with untimed costs: 0 s) change nothing: members then draft by their own pace alone."""

    plain: dict[int, float] = field(default_factory=dict)
    verify: dict[int, float] = field(default_factory=dict)
    wait: int = 0
    backoff: int = 1
    WEIGHT = 0.3
    MAX_WAIT = 64

    def would_draft(self) -> bool:   # what `drafts` would say now, without waiting less
        return self.wait <= 0

    def drafts(self) -> bool:
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def observe(self, rows: int, verified: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rates = self.verify if verified else self.plain
        rate, old = tokens / seconds, rates.get(rows)
        rates[rows] = rate if old is None else old + self.WEIGHT * (rate - old)
        plain, verify = self.plain.get(rows), self.verify.get(rows)
        if not verified or plain is None or verify is None:
            return
        if verify < plain:
            self.wait, self.backoff = self.backoff, min(self.backoff * 2, self.MAX_WAIT)
            del self.verify[rows]      # measured afresh when it tries again
        else:
            self.backoff = 1
