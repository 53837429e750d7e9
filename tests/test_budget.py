"""The memory-budget policy for managed models (issue 16), as tables: budget, footprints,
what is loaded, busy, pinned or grouped -> what a load unloads, waits for, or whether it can
ever fit; a worker's report -> its measured footprint; models without a cache budget -> the
share each gets."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixd.backends.budget import (
    MIN_SHARE,
    PROCESS_OVERHEAD,
    CacheNeed,
    ModelSlot,
    cache_shares,
    estimate_footprint,
    measured_footprint,
    over_budget,
    plan_load,
    weights_bytes,
)

G = 2**30


def S(name: str, gib: float, loaded: bool = False, **kw) -> ModelSlot:
    return ModelSlot(name, int(gib * G), loaded, **kw)


@pytest.mark.parametrize(("slots", "budget", "unload", "wait", "fits"), [
    # fits beside what is loaded
    ([S("t", 8), S("a", 10, True)], 32, [], [], True),
    # does not fit: the least recently used idle model goes first, only as many as needed
    ([S("t", 16), S("a", 10, True, last_used=5), S("b", 10, True, last_used=1),
      S("c", 4, True, last_used=9)], 32, ["b"], [], True),
    ([S("t", 24), S("a", 10, True, last_used=5), S("b", 10, True, last_used=1),
      S("c", 4, True, last_used=9)], 32, ["b", "a"], [], True),
    # a busy model is never unloaded: wait for it
    ([S("t", 20), S("a", 20, True, busy=True)], 32, [], ["a"], True),
    # a pinned model is never unloaded: if only pinned ones are in the way, it never fits
    ([S("t", 20), S("a", 20, True, pinned=True)], 32, [], [], False),
    # a pinned one stays, an idle one goes
    ([S("t", 10), S("a", 20, True, pinned=True), S("b", 8, True)], 32, ["b"], [], True),
    # same group: never loaded together, even when the budget would allow it
    ([S("t", 4, group="big"), S("a", 4, True, group="big"), S("b", 4, True)], 64,
     ["a"], [], True),
    ([S("t", 4, group="big"), S("a", 4, True, group="big", busy=True)], 64, [], ["a"], True),
    # larger than the whole budget: a clear no
    ([S("t", 40)], 32, [], [], False),
    # already loaded: nothing to do
    ([S("t", 40, True)], 32, [], [], True),
])
def test_plan_load(slots, budget, unload, wait, fits):
    plan = plan_load("t", slots, budget * G)
    assert (plan.unload, plan.wait_for, plan.fits) == (unload, wait, fits)
    assert plan.ready == (fits and not wait)
    if fits and not wait:       # what stays loaded plus the new model is within the budget
        kept = sum(s.footprint for s in slots if s.loaded and s.name not in plan.unload)
        assert kept + next(s.footprint for s in slots if s.name == "t") <= budget * G or \
            next(s for s in slots if s.name == "t").loaded


def test_unload_reasons():
    plan = plan_load("t", [S("t", 20, group="g"), S("a", 4, True, group="g"),
                           S("b", 20, True)], 32 * G)
    assert plan.reasons == {"a": "group", "b": "budget"}


def test_footprint_estimate(tmp_path: Path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "tokenizer.json").write_bytes(b"{}" * 100)
    assert weights_bytes(tmp_path) == 1000 and weights_bytes(tmp_path / "nope") == 0
    assert estimate_footprint(1000, 5000) == 1000 + 5000 + PROCESS_OVERHEAD


@pytest.mark.parametrize(("info", "footprint"), [
    # what the process holds + what its cache may still grow by
    ({"bytes_budget": 1000, "bytes_used": 400, "memory": {"rss_bytes": 5000}}, 5000 + 600),
    # MLX's buffers count when the resident set does not show them (Metal on Apple silicon)
    ({"bytes_budget": 1000, "bytes_used": 0,
      "memory": {"rss_bytes": 300, "mlx_active_bytes": 7000, "mlx_cache_bytes": 500}}, 8500),
    # a cache over its budget (never, but) leaves no room rather than negative room
    ({"bytes_budget": 100, "bytes_used": 150, "memory": {"rss_bytes": 5000}}, 5000),
    # no memory reported (an older or remote worker): keep the estimate
    ({"bytes_budget": 1000, "bytes_used": 0}, None),
    ({"memory": {"rss_bytes": 0}}, None),
    ({"memory": {"rss_bytes": True}}, None),
    (None, None),
    # a group worker: its ranks on this machine (the first host's, loopback), each with room
    # for its cache; a rank on another host counts against that host's memory
    ({"bytes_budget": 1000, "bytes_used": 400, "memory": {"rss_bytes": 5000},
      "group": {"hosts": ["10.0.0.1", "10.0.0.2", "127.0.0.1"], "ranks": [
          {"rank": 0, "host": "10.0.0.1", "memory": {"rss_bytes": 5000}},
          {"rank": 1, "host": "10.0.0.2", "memory": {"rss_bytes": 9000}},
          {"rank": 2, "host": "127.0.0.1", "memory": {"rss_bytes": 3000,
                                                      "mlx_active_bytes": 4000}}]}},
     5000 + 4000 + 2 * 600),
])
def test_measured_footprint(info, footprint):
    assert measured_footprint(info) == footprint


OH = PROCESS_OVERHEAD


def fits(shares: dict[str, int], needs: list[CacheNeed], together: list[str]) -> int:
    """Bytes that the models `together` hold with their shares."""
    by = {n.name: n for n in needs}
    return sum(by[n].weights + OH + (shares[n] if by[n].cache is None else by[n].cache)
               for n in together)


def test_models_that_fit_together_share_what_is_left():
    needs = [CacheNeed("coder", 8 * G, None), CacheNeed("small", 1 * G, None)]
    shares = cache_shares(needs, 32 * G)
    spare = 32 * G - (9 * G + 2 * OH)
    assert shares == {"coder": int(spare * 0.75) // 2, "small": int(spare * 0.75) // 2}
    assert fits(shares, needs, ["coder", "small"]) <= 32 * G


def test_one_group_counts_once_and_its_largest_member():
    needs = [CacheNeed("big", 30 * G, None, "big"), CacheNeed("mid", 20 * G, None, "big"),
             CacheNeed("small", 2 * G, None)]
    shares = cache_shares(needs, 48 * G)
    assert len(set(shares.values())) == 1 and shares["small"] >= 2 * G
    assert fits(shares, needs, ["big", "small"]) <= 48 * G     # the most that loads at once


def test_own_cache_budgets_are_kept_and_counted():
    needs = [CacheNeed("a", 4 * G, 6 * G), CacheNeed("b", 4 * G, None)]
    shares = cache_shares(needs, 32 * G)
    assert list(shares) == ["b"]
    assert fits(shares, needs, ["a", "b"]) <= 32 * G
    assert cache_shares([CacheNeed("a", G, G)], 32 * G) == {}


def test_models_that_cannot_fit_together_take_turns_with_half_the_rest_each():
    needs = [CacheNeed("a", 20 * G, None), CacheNeed("b", 12 * G, None)]
    shares = cache_shares(needs, 32 * G)
    assert shares == {"a": (12 * G - OH) // 2, "b": (20 * G - OH) // 2}
    assert fits(shares, needs, ["a"]) < 32 * G and fits(shares, needs, ["b"]) < 32 * G
    # too little left for a useful share each (under MIN_SHARE): also turns
    tight = [CacheNeed("a", G, None), CacheNeed("b", G, None)]
    budget = 2 * (G + OH) + MIN_SHARE
    assert cache_shares(tight, budget) == {"a": (budget - G - OH) // 2,
                                           "b": (budget - G - OH) // 2}
    # a model larger than the budget gets nothing (start-up refuses it anyway)
    assert cache_shares([CacheNeed("huge", 40 * G, None)], 32 * G) == {"huge": 0}


@given(st.lists(st.tuples(st.integers(0, 40), st.one_of(st.none(), st.integers(0, 8)),
                          st.sampled_from([None, "g", "h"])), min_size=1, max_size=5),
       st.integers(1, 64))
def test_every_model_that_fits_alone_still_fits_with_its_share(models, budget_gib):
    needs = [CacheNeed(f"m{i}", w * G, None if c is None else c * G, g)
             for i, (w, c, g) in enumerate(models)]
    shares = cache_shares(needs, budget_gib * G)
    assert set(shares) == {n.name for n in needs if n.cache is None}
    for n in needs:
        if n.weights + OH + (n.cache or 0) <= budget_gib * G:
            assert fits(shares, needs, [n.name]) <= budget_gib * G


@pytest.mark.parametrize(("slots", "unload"), [
    # within the budget: nothing
    ([S("k", 20, True), S("a", 10, True)], []),
    # the kept model measured more: idle ones go, least recently used first, only as needed
    ([S("k", 24, True), S("a", 6, True, last_used=5), S("b", 6, True, last_used=1)], ["b"]),
    # never the kept one, a busy one or a pinned one (the next plan deals with the rest)
    ([S("k", 30, True), S("a", 6, True, busy=True), S("b", 6, True, pinned=True)], []),
    # models not loaded hold nothing
    ([S("k", 30, True), S("a", 6), S("b", 6, True)], ["b"]),
])
def test_over_budget(slots, unload):
    assert over_budget(slots, 32 * G, keep="k") == unload
