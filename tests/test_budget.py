"""The memory-budget policy for managed models (issue 16), as a table: budget, footprints,
what is loaded, busy, pinned or grouped -> what a load unloads, waits for, or whether it can
ever fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixd.backends.budget import (
    PROCESS_OVERHEAD,
    ModelSlot,
    estimate_footprint,
    plan_load,
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
    assert estimate_footprint(tmp_path, 5000) == 1000 + 5000 + PROCESS_OVERHEAD
    assert estimate_footprint(None, 0) == PROCESS_OVERHEAD
