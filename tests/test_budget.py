"""The memory-budget policy for managed models (issue 16), as tables: budget, footprints,
what is loaded, busy, pinned or grouped -> what a load unloads, waits for, or whether it can
ever fit; a worker's report -> its measured footprint; models without a cache budget -> the
share each gets; a group of ranks (issue 47) -> estimated, shared and measured per rank on this
machine, so that models whose shares fit together still fit once their workers measure them."""

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
    Ranks,
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
    # a group's ranks here: their part of the weights, a process and a cache budget each
    assert estimate_footprint(900, 5000, Ranks(2, 2)) == 900 + 2 * (5000 + PROCESS_OVERHEAD)
    assert estimate_footprint(900, 5000, Ranks(3, 2)) == 600 + 2 * (5000 + PROCESS_OVERHEAD)


@pytest.mark.parametrize(("hosts", "ranks"), [
    ([], Ranks(1, 1)),
    (["10.0.0.1"], Ranks(1, 1)),
    (["127.0.0.1", "127.0.0.1"], Ranks(2, 2)),
    (["mac1", "mac1", "mac1", "mac1"], Ranks(4, 4)),
    (["10.0.0.1", "10.0.0.2"], Ranks(2, 1)),
    (["10.0.0.1", "10.0.0.2", "localhost"], Ranks(3, 2)),
])
def test_ranks_on_this_machine(hosts, ranks):
    """The first host is this machine, and so is every loopback one."""
    assert Ranks.of(hosts) == ranks


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


def report(ranks: Ranks, held: list[int], budget: int, used: int = 0) -> dict:
    """A worker's GET /v1/cache as the real one writes it: one process, or a group's leader
    (rank 0) with its followers' memory and cache bytes from their heartbeats; `ranks.here`
    of them on this machine (the first host and loopback ones), the others elsewhere."""
    memory = [{"rss_bytes": h, "rss_source": "statm", "mlx_active_bytes": h // 100,
               "mlx_cache_bytes": h // 200} for h in held]
    info = {"bytes_budget": budget, "bytes_used": used, "memory": memory[0], "group": None}
    if ranks.total > 1:
        hosts = ["10.0.0.1", *["127.0.0.1"] * (ranks.here - 1),
                 *[f"10.0.1.{i}" for i in range(ranks.total - ranks.here)]]
        info["group"] = {"hosts": hosts, "parallel": "tensor", "ranks": [
            {"rank": r, "host": h, "pid": 100 + r, "memory": memory[r],
             **({"cache_bytes": used, "jobs": 0} if r else {})}
            for r, h in enumerate(hosts)]}
    return info


def test_a_follower_counts_the_room_its_own_cache_has_left():
    info = report(Ranks(2, 2), [5000, 5000], 1000, used=400)
    info["group"]["ranks"][1]["cache_bytes"] = 900
    assert measured_footprint(info) == 2 * 5000 + 600 + 100


MB = 10**6


def measured_alone(need: CacheNeed, share: dict[str, int], held: int) -> int | None:
    """What `need`'s worker measures once loaded with its cache budget, nothing cached yet,
    each rank holding `held` bytes: rank 0 its part of the weights besides."""
    budget = need.cache if need.cache is not None else share[need.name]
    part = need.weights // need.ranks.total
    return measured_footprint(report(need.ranks, [held + part] * need.ranks.total, budget))


@pytest.mark.parametrize("layout", [
    # the outside check of issue 47: one worker and a two-rank group of a tiny model
    [Ranks(), Ranks(2, 2)],
    [Ranks(2, 2), Ranks(2, 2)],                 # a group beside a group
    [Ranks(), Ranks(3, 2), Ranks(4, 4)],        # three ranks, one on another host; four
    [Ranks(2, 1), Ranks()],                     # a group with one rank here
])
def test_a_group_beside_its_neighbours_fits_as_measured(layout: list[Ranks]):
    """Issue 47: an 8 GB budget, a tiny model (a few MB) in each worker, every rank holding
    what the outside check measured (~150 MB resident). Their shares fit them together, so
    each measures no more than the pool estimated, the loaded ones stay within the budget and
    a load of any of them beside the others unloads nothing. Before, a group's ranks each got
    the group's whole share as their cache budget: the group measured twice its estimate and
    its every load unloaded the single worker, and the worker's every load the group."""
    budget = 8_000_000_000
    needs = [CacheNeed(f"m{i}", 4 * MB, None, ranks=r) for i, r in enumerate(layout)]
    shares = cache_shares(needs, budget)
    estimates = {n.name: estimate_footprint(n.weights, shares[n.name], n.ranks) for n in needs}
    assert sum(estimates.values()) <= budget              # the shares fit them together
    measured = {n.name: measured_alone(n, shares, 150 * MB) for n in needs}
    for n in needs:
        assert measured[n.name] <= estimates[n.name], n.ranks
    loaded = [ModelSlot(n, f, True, last_used=i) for i, (n, f) in enumerate(measured.items())]
    for slot in loaded:
        assert over_budget(loaded, budget, keep=slot.name) == []
        others = [s if s is not slot else ModelSlot(s.name, estimates[s.name], False)
                  for s in loaded]
        assert plan_load(slot.name, others, budget).unload == []


def test_an_own_cache_budget_is_each_ranks():
    """A group's own `cache_bytes` (or PREFIXD_CACHE_BYTES) is each rank's budget: its ranks
    here hold it once each, and the shares of the others leave room for all of them."""
    needs = [CacheNeed("pair", 4 * MB, 2 * G, ranks=Ranks(2, 2)), CacheNeed("one", 4 * MB, None)]
    shares = cache_shares(needs, 8 * G)
    estimate = estimate_footprint(4 * MB, 2 * G, Ranks(2, 2))
    assert measured_alone(needs[0], shares, OH) == estimate
    assert estimate + estimate_footprint(4 * MB, shares["one"]) <= 8 * G


OH = PROCESS_OVERHEAD


def fits(shares: dict[str, int], needs: list[CacheNeed], together: list[str]) -> int:
    """Bytes that the models `together` hold on this machine with their shares."""
    by = {n.name: n for n in needs}
    return sum(estimate_footprint(by[n].weights, shares.get(n, by[n].cache or 0), by[n].ranks)
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


RANKS = st.sampled_from([Ranks(), Ranks(2, 2), Ranks(2, 1), Ranks(3, 2), Ranks(4, 4)])


@given(st.lists(st.tuples(st.integers(0, 40), st.one_of(st.none(), st.integers(0, 8)),
                          st.sampled_from([None, "g", "h"]), RANKS), min_size=1, max_size=5),
       st.integers(1, 64))
def test_every_model_that_fits_alone_still_fits_with_its_share(models, budget_gib):
    needs = [CacheNeed(f"m{i}", w * G, None if c is None else c * G, g, r)
             for i, (w, c, g, r) in enumerate(models)]
    shares = cache_shares(needs, budget_gib * G)
    assert set(shares) == {n.name for n in needs if n.cache is None}
    for n in needs:
        if estimate_footprint(n.weights, n.cache or 0, n.ranks) <= budget_gib * G:
            assert fits(shares, needs, [n.name]) <= budget_gib * G


@given(st.lists(st.tuples(st.integers(0, 8), RANKS), min_size=1, max_size=4),
       st.integers(1, 64))
def test_models_whose_shares_fit_together_fit_together_as_measured(models, budget_gib):
    """Whatever the ranks: if the shares let the models stay loaded together, their workers
    measure (each rank holding a process's overhead, caches empty) no more than that."""
    needs = [CacheNeed(f"m{i}", w * G, None, ranks=r) for i, (w, r) in enumerate(models)]
    shares = cache_shares(needs, budget_gib * G)
    if fits(shares, needs, [n.name for n in needs]) <= budget_gib * G:
        assert sum(measured_alone(n, shares, OH) for n in needs) <= budget_gib * G


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
