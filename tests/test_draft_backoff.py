"""A model drafter that keeps missing backs off to about nothing (issue 51): its probes ever
rarer while its drafts are rejected (to one every `Pace.MODEL_MAX_WAIT` tokens), its standing
carried from one request to the next, drafting again soon after it starts being accepted.
Pure policy (`engine/spec/draft.py`): no mlx, no time (the costs untimed, as a group's)."""

from __future__ import annotations

import random

from prefixd.backends.mlx.engine.spec.draft import DraftCosts, Pace, PassCosts, Standing


def _decode(pace: Pace, tokens: int, accepted: bool, lengths: list[int] | None = None
            ) -> tuple[int, int | None]:
    """`tokens` tokens decoded with `pace` sizing the model drafter's drafts, each accepted
    whole or rejected whole: how many drafts it verified, and the token of its first
    (`lengths`: every length asked, in order)."""
    drafts, first, t = 0, None, 0
    while t < tokens:
        k = pace.length(Pace.MODEL)
        if lengths is not None:
            lengths.append(k)
        if k:
            drafts += 1
            first = t if first is None else first
            pace.update(Pace.MODEL, k, k if accepted else 0)
        t += 1 + (k if k and accepted else 0)
    return drafts, first


def _pace(standing: Standing | None = None) -> Pace:
    return Pace(8, DraftCosts(PassCosts(timed=False)), standing=standing)


def test_a_head_that_keeps_missing_is_probed_ever_more_rarely() -> None:
    """2,000 tokens of rejected drafts: at most 16 drafts (waits capped at 64, as a lookup's
    are, it was 36), the last ones a probe every `MODEL_MAX_WAIT` tokens; then accepted, it
    drafts again at its next probe (within `MODEL_MAX_WAIT` tokens) and from there on about
    every other pass."""
    pace = _pace()
    drafts, _ = _decode(pace, 2000, accepted=False)
    assert drafts <= 16
    rate = pace.rates[Pace.MODEL]
    assert rate.backoff == Pace.MODEL_MAX_WAIT
    again, first = _decode(pace, 400, accepted=True)
    assert first is not None and first <= Pace.MODEL_MAX_WAIT
    assert again >= 30
    assert pace.rates[Pace.MODEL].backoff <= 2      # reset by acceptance

    before = _pace()
    before.MODEL_MAX_WAIT = Pace.MAX_WAIT            # the old cap, a lookup's
    assert _decode(before, 2000, accepted=False)[0] >= 2 * drafts


def test_its_standing_carries_from_one_request_to_the_next() -> None:
    """Ten requests of 200 tokens, none of their drafts accepted: each starting afresh drafts
    about 8 times (a long first draft, then probes after 1, 2, 4, ... tokens); starting from
    the worker's standing, only the first does, the others a probe or none. A request after
    one whose drafts were accepted drafts at once."""
    fresh = [_decode(_pace(), 200, accepted=False)[0] for _ in range(10)]
    assert min(fresh) >= 7
    standing = Standing()
    kept = [_decode(_pace(standing), 200, accepted=False)[0] for _ in range(10)]
    assert kept[0] == fresh[0] and max(kept[1:]) <= 2 and sum(kept) <= 16
    _decode(_pace(standing), 600, accepted=True)
    assert _decode(_pace(standing), 50, accepted=True)[1] == 0


def test_lookups_wait_as_before_and_decisions_do_not_depend_on_time() -> None:
    """A copy's waits stay capped at `MAX_WAIT` (a reply may reach a part that copies any
    time); with untimed costs the lengths are the same whatever the passes took."""
    pace = _pace()
    for _ in range(20):
        pace.length(2)
        pace.update(2, 1, 0)
    assert max(r.backoff for r in pace.rates.values()) == Pace.MAX_WAIT
    runs = []
    for seed in (1, 2):
        paced, times, lengths = _pace(), random.Random(seed), []
        outcomes = random.Random(0)     # the same acceptance, other times
        assert isinstance(paced.costs, DraftCosts)
        for _ in range(50):
            paced.costs.observe(3, times.random())
            paced.costs.base.observe(times.randrange(1, 9), times.random())
            _decode(paced, 40, accepted=outcomes.random() < 0.5, lengths=lengths)
        runs.append(lengths)
    assert runs[0] != [] and runs[0] == runs[1]
