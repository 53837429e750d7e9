"""Speculative decoding (issue 36): drafts looked up in the request's own context, verified in
one forward pass, the live cache brought back exactly to the last accepted token on every
cache kind prefixd serves (full-attention KV, sliding windows, Gated-DeltaNet, Mamba2, LFM2's
short convolutions). Greedy replies equal decoding one token at a time; seeded sampled ones
draw the same tokens; a reply that ends among accepted tokens, or whose client leaves, leaves
exactly its tokens cached, and the next turn is warm and equals cold.

The tiny models write from a handful of tokens, so their replies repeat themselves and the
lookup drafts often, with drafts both accepted and rejected (every rewind path runs)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import mlx.core as mx
import pytest
from aiohttp.test_utils import TestClient, TestServer

from prefixd.api.structured import Constraint
from prefixd.backends.managed import ManagedBackend
from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.engine.config import EngineConfig
from prefixd.backends.mlx.engine.engine import Engine
from prefixd.backends.mlx.engine.inpass.captured import Captured, RowOf
from prefixd.backends.mlx.engine.spec.company import BatchPace, Offer, emitted, width
from prefixd.backends.mlx.engine.spec.draft import Pace, PassCosts, Rate, fair_width
from prefixd.backends.mlx.engine.spec.draftmodel import ModelDrafter
from prefixd.backends.mlx.engine.spec.lookup import PromptLookup
from prefixd.backends.mlx.model.tiny import (
    ARCHS,
    EXTRA_ARCHS,
    build_model,
    model_from_config,
    restrict_output,
    save_tiny_model,
    tiny_config,
)
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.scheduler.jobs import Finished, Job
from prefixd.backends.mlx.server.app import create_app
from prefixd.backends.mlx.settings import WorkerSettings
from prefixd.backends.supervision.states import ProcState
from prefixd.proxy.server import Server, make_proxy
from prefixd.proxy.settings import Settings
from tests.engine_steps import generate, turn_for
from tests.worker_fixtures import collect, on_and_off, untimed

ALPHABET = [5, 6, 7, 8]
LOGPROB_TOLERANCE = 1e-4
# a reply of hundreds of tokens decoded in batched passes: each row's keys and values were
# computed in passes of other shapes than alone, and the rounding adds up along the reply
# (measured with Debian's OpenBLAS, as CI runs: up to 2.1e-4 at log-probabilities near -2
# over 384 tokens, tokens identical; 0 with MLX's bundled BLAS)
LONG_LOGPROB_TOLERANCE = 5e-4


def _proposed(lookup: PromptLookup, k: int) -> tuple[list[int], int]:
    """What `lookup` proposes after the tokens it holds, and how far its match reaches."""
    return lookup.propose(lookup.buf[:lookup.n].tolist(), k), lookup.reach


# --- drafting policy (pure) --------------------------------------------------------------------
def test_prompt_lookup_copies_from_the_occurrence_whose_match_reaches_furthest_back() -> None:
    # the suffix [2, 3] occurs at 1 (preceded by 1, as the suffix is: a 3-token match) and at
    # 6 (preceded by 9): the longer match is copied, not the latest
    lookup = PromptLookup([1, 2, 3, 4, 7, 9, 2, 3, 5, 1, 2, 3], capacity=8, ngram=2)
    assert _proposed(lookup, 3) == ([4, 7, 9], 3)
    lookup.extend([8])           # [3, 8] never occurred
    assert _proposed(lookup, 3) == ([], 0)
    assert _proposed(lookup, 0) == ([], 0)
    ties = PromptLookup([5, 6, 1, 5, 6, 2, 5, 6], capacity=4, ngram=2)
    assert _proposed(ties, 1) == ([2], 2)      # equal matches: the latest


def test_prompt_lookup_follows_where_most_earlier_occurrences_went() -> None:
    # [1, 2] went on to 3, 4 twice and to 7, 8 once (the latest): the majority's way is
    # drafted (a loop the reply fell into goes on as it mostly went), token by token
    mostly = PromptLookup([1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 1, 2, 7, 8, 6, 1, 2], capacity=4,
                          ngram=2)
    assert _proposed(mostly, 2) == ([3, 4], 2)
    # they agree on 3, then split 4 / 9 / 9: the continuation follows the ones still agreeing
    split = PromptLookup([1, 2, 3, 4, 0, 1, 2, 3, 9, 5, 1, 2, 3, 9, 6, 1, 2], capacity=4,
                         ngram=2)
    assert _proposed(split, 2) == ([3, 9], 2)
    # reach outweighs count: one occurrence matching 4 tokens back (weight 64) beats three
    # matching 2 (weight 8 each)
    far = PromptLookup([5, 6, 1, 2, 7, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 5, 6, 1, 2],
                       capacity=4, ngram=2)
    assert _proposed(far, 1) == ([7], 4)


def test_prompt_lookup_asked_again_answers_as_a_fresh_one() -> None:
    # asked again for the same context (a batch launching ahead asks before its next step
    # offers), for fewer tokens, and after the context grew: each answer is a fresh lookup's
    tokens = [1, 2, 3, 4, 0, 1, 2, 3, 9, 5, 1, 2, 3, 9, 6, 1, 2]
    lookup = PromptLookup(tokens, capacity=8, ngram=2)
    first = _proposed(lookup, 4)
    assert _proposed(lookup, 4) == first == _proposed(PromptLookup(tokens, 8, 2), 4)
    assert _proposed(lookup, 2) == (first[0][:2], first[1])
    lookup.extend([3])
    assert _proposed(lookup, 4) == _proposed(PromptLookup([*tokens, 3], 8, 2), 4) != first


def test_prompt_lookup_continues_a_copy_that_runs_into_its_own_end() -> None:
    loop = PromptLookup([9, 1, 2, 3, 1, 2, 3, 1, 2], capacity=2, ngram=2)
    assert _proposed(loop, 7) == ([3, 1, 2, 3, 1, 2, 3], 5)
    loop.extend([3, 1, 2, 3])    # past its capacity: the buffer grows
    assert _proposed(loop, 2) == ([1, 2], 9)   # back to the 9 it starts after
    assert _proposed(PromptLookup([4], capacity=1, ngram=2), 3) == ([], 0)


def test_a_request_whose_drafts_fail_drafts_rarely_and_one_that_copies_drafts_long() -> None:
    costs = PassCosts(timed=False)
    prose = Pace(8, costs)
    drafted = 0
    for _ in range(300):
        k = prose.length(6)
        if k:
            drafted += 1
            prose.update(6, k, 0)
    assert 0 < drafted <= 12          # probes, ever further apart (backoff to 64 steps)
    copying = Pace(8, costs)
    lengths = []
    for _ in range(20):
        k = copying.length(6)
        lengths.append(k)
        copying.update(6, k, k)
    assert lengths[-1] == 8 and all(k > 0 for k in lengths)
    # the kinds of match learn apart: a failing short match does not stop long ones
    mixed = Pace(8, costs)
    for _ in range(50):
        if k := mixed.length(2):
            mixed.update(2, k, 0)
    assert mixed.length(20) >= 4
    assert mixed.length(2) == 0


def test_a_copy_rejected_alone_drafts_again_at_once_sized_by_its_lowered_acceptance() -> None:
    """Verified by a request alone, a copy none of whose drafted tokens were accepted (a line
    break the reply moved) does not wait: the next position drafts again, shorter, its
    acceptance lowered; a batch member's, or a model drafter's, waits as before."""
    costs = PassCosts(timed=False)
    alone = Pace(8, costs)
    first = alone.length(17)
    alone.update(17, first, 0, alone=True)
    again = alone.length(17)
    assert 0 < again < first
    for reach, company in ((17, True), (Pace.MODEL, False)):
        waits = Pace(8, costs)
        k = waits.length(reach)
        assert k > 0
        waits.update(reach, k, 0, alone=not company)
        assert waits.length(reach) == 0


def test_a_draft_its_batch_declines_probes_ever_more_rarely_even_where_probes_are_accepted(
        ) -> None:
    """A decline is the batch's cost deciding: the member's drafts of that reach wait 1, 2,
    4 ... steps, then probe (one token its batch verifies whatever it costs, to learn its
    acceptance). An accepted probe says drafts may pay, not that they do: the wait after the
    next decline is still twice as long (before, an accepted probe brought it back to one
    step, and four rows in prose whose probes were accepted made one pass in three a verify
    pass). A draft that paid, verified and accepted, brings it back to one step."""
    pace = Pace(8, PassCosts(timed=False))
    offers: list[tuple[float, bool] | None] = []
    for _ in range(48):
        offers.append(got := pace.offer(2))
        if got is not None and got[1]:
            pace.update(2, 1, 1)          # a probe: verified by its batch, and accepted
        elif got is not None:
            pace.decline(2)
    assert [i for i, o in enumerate(offers) if o is not None and o[1]] == [2, 6, 12, 22, 40]
    assert [i for i, o in enumerate(offers) if o is not None and not o[1]] == \
        [0, 3, 7, 13, 23, 41]
    assert pace.offer(2) is None
    pace.rates[2].wait = 0
    assert pace.offer(2) == (pytest.approx(pace.alpha(2)), True)
    pace.update(2, 1, 1)
    assert pace.offer(2) is not None          # offered as any: this time its batch verifies it
    pace.update(2, 3, 3)
    pace.decline(2)
    assert pace.offer(2) is None and pace.offer(2) is not None   # one step's wait again
    # a probe after a rejection (acceptance, not cost, made it wait), accepted: drafts of it
    # may pay again, and the next wait is one step (a head that starts guessing right)
    pace.update(2, 1, 0)
    pace.rates[2].wait = 0
    assert pace.offer(2) == (pytest.approx(pace.alpha(2)), True)
    pace.update(2, 1, 1)
    pace.decline(2)
    assert pace.offer(2) is None and pace.offer(2) is not None


def test_pass_costs_use_measured_ratios_else_the_prior_shape() -> None:
    costs = PassCosts()
    assert costs.ratio(1) == 1.0
    assert costs.ratio(5) == pytest.approx(1 + 4 * PassCosts.PRIOR_SLOPE)
    costs.observe(1, 0.05)
    costs.observe(4, 0.06)
    assert costs.ratio(4) == pytest.approx(1.2)
    # a length not measured yet: priced as the longest measured below it, so that it is tried
    # (on a CPU a pass of 16 tokens can cost less than one of 12), then measured
    assert costs.ratio(6) == pytest.approx(1.2)
    costs.observe(6, 0.08)
    assert costs.ratio(6) == pytest.approx(1.6)
    assert costs.ratio(5) == pytest.approx(1.2)
    # a decode batch's verify pass is not tried on hope: the prior's slope above its plain
    # step (2 rows, 2 tokens: a 2-token pass on the prior), 2 tokens more
    costs.observe(2, 0.12, rows=2)
    assert costs.ratio(4, rows=2) == pytest.approx(1 + 3 * PassCosts.PRIOR_SLOPE)
    costs.observe(2, 0.01)            # a pass is never cheaper than a one-token pass
    assert costs.ratio(2) == 1.0
    # no one-token pass measured (every step drafted): its cost estimated through the prior
    drafting = PassCosts()
    drafting.observe(3, 0.13)
    assert drafting.one() == pytest.approx(0.1)
    assert drafting.ratio(3) == pytest.approx(1.3)
    prior = PassCosts(timed=False)
    prior.observe(1, 0.05)
    assert prior.seconds == {}


def test_a_batch_member_drafts_by_what_its_batch_pass_costs() -> None:
    """A pass whose cost grows with its tokens: a request alone drafts, the same request
    in a decode batch of four (each drafting as much: four times the tokens) drafts less or
    not at all, and where batched passes cost about what one does it drafts as alone."""
    steep = PassCosts()
    for n, seconds in ((1, 0.010), (2, 0.011), (4, 0.012), (8, 0.024), (12, 0.036),
                       (16, 0.048), (20, 0.060), (24, 0.072), (36, 0.108)):
        steep.observe(n, seconds)
    alone, batched = Pace(8, steep), Pace(8, steep)
    assert alone.length(20) >= 3
    assert batched.length(20, rows=4) == 0
    flat = PassCosts()
    for n in (1, 2, 4, 8, 12, 16, 20, 24, 36):
        flat.observe(n, 0.010)
    assert Pace(8, flat).length(20, rows=4) >= 7 and Pace(8, flat).length(20) >= 7


def test_a_batch_member_prices_its_draft_by_what_the_whole_pass_emits() -> None:
    """The other members of a batch get one token from a pass however wide a member's draft
    makes it: a draft that would pay for its own request (0.35 expected extra tokens against a
    pass 25% dearer) does not pay for a batch of two, whose other token costs 25% more too."""
    costs = PassCosts()
    for n, seconds in ((1, 0.010), (2, 0.010), (4, 0.0125), (6, 0.02), (8, 0.03)):
        costs.observe(n, seconds)
    assert Pace(8, costs).length(2) >= 1           # alone: 1 + 0.35 tokens for 1.0x
    assert Pace(8, costs).length(2, rows=2) == 0   # a batch: 2 + 0.35 tokens for 1.25x


def test_a_member_drafting_nothing_steps_at_most_fair_times_slower() -> None:
    """A batch where some member drafts nothing verifies the others' drafts in a pass at most
    FAIR times as costly as a plain step of the batch (measured costs); where a pass costs
    about the same however wide (a GPU), the drafts go whole."""
    steep = PassCosts()
    for n in range(1, 40):
        steep.observe(n, 0.010 * (1 + 0.1 * (n - 1)))   # +10% a token
    # two rows: a plain step is 2 tokens (1.1x); 1.5 x 1.1 = 1.65x allows 7 tokens: width 3
    assert fair_width(steep, 2, 17) == 3
    assert fair_width(steep, 4, 17) == 2        # 4 rows: 12 tokens (2.1x) > 1.5 x 1.3x
    flat = PassCosts()
    for n in range(1, 80):
        flat.observe(n, 0.010)
    assert fair_width(flat, 4, 17) == 17


def test_a_batch_prices_its_pass_by_its_own_shape_not_a_lone_pass_of_as_many_tokens() -> None:
    """A pass of 8 tokens is not one cost: one request verifying 7 drafted tokens (measured
    cheap, 1.2x a one-token pass) says nothing of 4 rows verifying one each. The batch's
    pass is priced from its own plain steps (4 rows: 1.9x), the prior's slope above them
    (2.5x for 8 tokens): one row's one-token draft (acceptance 0.8) beside three that draft
    nothing does not pay (4.8 tokens for 1.3x a plain step); four rows' do. Measured at that
    shape, the measurement decides."""
    costs = PassCosts()
    costs.observe(1, 0.050)
    costs.observe(8, 0.060)                 # one request, 7 drafted tokens
    costs.observe(4, 0.095, rows=4)         # a plain step of 4 rows
    one = [Offer([7], 0.8), None, None, None]
    assert costs.ratio(8) == pytest.approx(1.2)
    assert costs.ratio(8, rows=4) == pytest.approx(
        (1 + 3 * PassCosts.PRIOR_SLOPE) + 4 * PassCosts.PRIOR_SLOPE)
    assert width(one, costs) == 1
    assert width([Offer([7], 0.8)] * 4, costs) == 2
    costs.observe(8, 0.100, rows=4)         # 4 rows x 2 measured: about a plain step's cost
    assert costs.ratio(8, rows=4) == pytest.approx((1 + 3 * PassCosts.PRIOR_SLOPE) * 100 / 95)
    assert width(one, costs) == 2
    assert costs.ratio(8) == pytest.approx(1.2)     # the lone request's own, as it was


def test_a_batch_of_copying_rows_drafts_together_where_each_alone_would_not() -> None:
    """The width of a batch's verify pass is decided for the whole pass: four rows copying
    (acceptance 0.8) each pay for their own positions, so together they verify drafts that
    no one of them would size for itself in company (its own tokens against the whole pass)."""
    costs = PassCosts(timed=False)     # the prior: +15% a token
    copying = [Offer(list(range(8)), 0.8) for _ in range(4)]
    pace = Pace(8, costs)
    pace.rates[9] = Rate(0.8 * 3, 0.2 * 3)     # a long match's rate at 0.8
    assert pace.length(9, rows=4) == 0         # alone in company: 1.6 tokens for 2.7x
    # together: 4 x 2.44 tokens for 2.65x of one token's pass, against 4 for 1.45x (wider
    # emits more a pass, less a unit of cost: 4 x 2.95 for 3.25x)
    assert width(copying, costs) == 3
    # a row that offers nothing keeps its pass at most FAIR times a plain step's
    assert width([*copying[:3], None], costs) == fair_width(costs, 4, 9)
    # rows that guess badly verify nothing; a long offer beside short ones is cut to the width
    assert width([Offer([1, 2], 0.2)] * 4, costs) == 1
    # ... but a row probing after its wait is verified anyway (one drafted token), to learn
    assert width([Offer([1, 2], 0.2, probe=True), *[Offer([1, 2], 0.2)] * 3], costs) == 2
    mixed = [Offer(list(range(8)), 0.95), Offer([7], 0.95), Offer([5, 6], 0.95), None]
    assert width(mixed, costs) <= fair_width(costs, 4, 9)
    # measured (the built-in model: 4 rows x 1 95 ms, x 2 110 ms): one row's draft accepted
    # 80% of the time beside three drafting nothing gains the batch 3.6% of tokens per unit
    # cost, not the 10% (`SHARED`) that pays the three their slower step; two such rows do
    measured = PassCosts()
    measured.observe(4, 0.095, rows=4)
    measured.observe(8, 0.110, rows=4)
    assert width([Offer([1, 2], 0.8), None, None, None], measured) == 1
    assert width([Offer([1, 2], 0.8), Offer([3], 0.8), None, None], measured) == 2
    assert width([Offer([1, 2], 0.8)] * 4, measured) >= 2
    flat = PassCosts()
    for n in range(1, 80):
        flat.observe(n, 0.010)
    assert width(copying, flat) == 9           # a pass as cheap however wide: all of it
    assert emitted(0.8, 0) == 1.0 and emitted(0.5, 2) == 1.75


def test_a_batch_stops_drafting_while_its_verify_passes_emit_less_per_second() -> None:
    """Verify passes that emit fewer tokens per second than plain steps of the same batch
    size (every cost counted) stop the batch drafting for ever longer waits, then it tries
    again; verify passes that emit more keep it drafting; unmeasured passes change nothing."""
    pace = BatchPace()
    pace.observe(4, False, 4, 0.080)           # plain steps: 50 tokens/s
    pace.observe(4, True, 7, 0.200)            # verify: 35 tokens/s
    waits = 0
    while not pace.drafts():
        waits += 1
    assert waits == 1
    pace.observe(4, True, 6, 0.200)            # still slower: twice as long
    waits = 0
    while not pace.drafts():
        waits += 1
    assert waits == 2
    pace.observe(4, True, 16, 0.200)           # 80 tokens/s: it drafts every step
    assert all(pace.drafts() for _ in range(10))
    pace.observe(2, True, 1, 0.200)            # another batch size: no plain rate yet
    assert pace.drafts()
    unmeasured = BatchPace()
    unmeasured.observe(4, False, 4, 0.0)
    unmeasured.observe(4, True, 1, 0.0)
    assert unmeasured.drafts() and not unmeasured.plain


# --- exactness on every cache kind (the Engine, in-process) -------------------------------------
def _greedy(lp: mx.array) -> mx.array:
    return mx.argmax(lp, axis=-1)


@pytest.fixture(scope="module", params=ARCHS + EXTRA_ARCHS)
def small_alphabet_model(request: pytest.FixtureRequest) -> tuple[str, Any]:
    model = build_model(request.param)
    restrict_output(model, ALPHABET)
    return request.param, model


def test_greedy_replies_with_speculation_equal_replies_without_on_every_cache_kind(
        small_alphabet_model: tuple[str, Any]) -> None:
    arch, model = small_alphabet_model
    rng = random.Random(1)
    spec = Engine(model, EngineConfig(cache_bytes=1 << 28))
    plain = Engine(model, EngineConfig(cache_bytes=1 << 28, speculative=False))
    assert spec.unspeculative is None, spec.unspeculative
    totals = {"drafted": 0, "accepted": 0, "passes": 0}
    rewound = 0
    for n in (40, 75, 150):       # gemma3's windows (128) wrap in the last
        prompt = [rng.choice(ALPHABET) for _ in range(n)]
        turn = turn_for(spec)
        got = list(generate(spec, prompt, sampler=_greedy, max_tokens=70, turn=turn))
        want = list(generate(plain, prompt, sampler=_greedy, max_tokens=70))
        assert got == want, arch
        assert turn.stats is not None and turn.stats.speculative is not None
        for k in totals:
            totals[k] += turn.stats.speculative[k]
        rewound += turn.stats.speculative["drafted"] > turn.stats.speculative["accepted"]
    # drafts were verified, some accepted, some rejected (the cache went back)
    assert totals["passes"] > 5 and 0 < totals["accepted"] < totals["drafted"], totals
    assert rewound


def test_the_next_turn_after_a_speculative_reply_restores_all_of_it_and_equals_cold(
        small_alphabet_model: tuple[str, Any]) -> None:
    """Replies cut by max_tokens at every length, so some end among tokens a verify pass
    accepted: the cache goes back to the reply's last token, the entry holds prompt + reply,
    and the next turn restores all of it and replies as a cold run."""
    arch, model = small_alphabet_model
    rng = random.Random(2)
    spec = Engine(model, EngineConfig(cache_bytes=1 << 28))
    base = [rng.choice(ALPHABET) for _ in range(50)]
    for max_tokens in range(2, 15):
        prompt = [*base, *(rng.choice(ALPHABET) for _ in range(max_tokens))]
        reply = list(generate(spec, prompt, sampler=_greedy, max_tokens=max_tokens))
        assert len(reply) == max_tokens
        follow = [*prompt, *reply, 5, 6]
        assert spec.cached_now(follow) == len(prompt) + len(reply), (arch, max_tokens)
        turn = turn_for(spec)
        warm = list(generate(spec, follow, sampler=_greedy, max_tokens=12, turn=turn))
        cold = list(generate(Engine(model, EngineConfig(cache_bytes=1 << 28,
                                                        speculative=False)),
                             follow, sampler=_greedy, max_tokens=12))
        assert turn.stats is not None and turn.stats.cached_tokens == len(prompt) + len(reply)
        assert warm == cold, (arch, max_tokens)


def _hybrid_engines(arch: str = "qwen3_next") -> tuple[Engine, Engine, list[int]]:
    """A tiny model writing the alphabet (qwen3_next; gemma3_text with a window of 48, which
    the prompt and reply wrap; "-replay": recurrent states computed again where needed, never
    kept per position): Engines with and without speculation, and a 60-token prompt. Drafts
    sized by fixed costs, never by time: what gets drafted here is the same on any machine."""
    arch, _, replay = arch.partition("-")
    if arch == "gemma3_text":
        model = model_from_config({**tiny_config(arch), "sliding_window": 48})
    else:
        model = build_model(arch)
    restrict_output(model, ALPHABET)
    spec = Engine(model, EngineConfig(cache_bytes=1 << 28,
                                      spec_capture_bytes=0 if replay else 1 << 30))
    assert spec.spec is not None
    spec.spec.costs.timed = False     # and passes cost the same however wide (a GPU's shape):
    spec.spec.costs.seconds = {n: 0.01 for n in range(1, 256)}   # batches draft long
    plain = Engine(model, EngineConfig(cache_bytes=1 << 28, speculative=False))
    rng = random.Random(4)
    prompt = [rng.choice(ALPHABET) for _ in range(60)]
    return spec, plain, prompt


CLOSING_ARCHS = ["qwen3_next", "gemma3_text", "qwen3_next-replay", "falcon_h1-replay"]


@pytest.mark.parametrize("arch", CLOSING_ARCHS)
def test_a_reply_closed_among_accepted_tokens_keeps_only_what_was_yielded(arch: str) -> None:
    """The caller closes the reply (a stop string, EOS) right after a token a verify pass
    accepted, with more accepted after it: they leave the cache, which holds the prompt and
    the tokens yielded, and the next turn from there equals cold."""
    spec, plain, prompt = _hybrid_engines(arch)
    among = replayed = 0
    for cut in range(2, 30):
        other = [9, cut, *prompt]     # a prompt of its own each time
        turn = turn_for(spec)
        steps = generate(spec, other, sampler=_greedy, max_tokens=40, turn=turn)
        got = [next(steps) for _ in range(cut)]
        assert turn.run is not None and turn.run.spec is not None
        among += len(turn.run.ahead) > 1     # accepted tokens not yielded yet
        replayed += _replayed(turn.run.spec.captured)
        steps.close()
        follow = [*other, *got, 5]
        assert spec.cached_now(follow) == len(other) + cut
        warm = list(generate(spec, follow, sampler=_greedy, max_tokens=8))
        assert warm == list(generate(plain, follow, sampler=_greedy, max_tokens=8))
    assert among
    assert bool(replayed) == arch.endswith("-replay")


@pytest.mark.parametrize("arch", CLOSING_ARCHS)
def test_batched_replies_closed_among_accepted_tokens_keep_only_what_was_yielded(
        arch: str) -> None:
    """Requests decoding in one batch (stepped as the scheduler steps them), each closed after
    its own number of tokens, some among tokens a batched verify pass accepted: once out of
    the batch, each cache goes back to its last yielded token (recurrent states from those
    captured in the batch's pass; a wrapped window, which the batch does not capture, cut back
    from the positions the pass left it), holds prompt + reply (its last token left out where
    others decode on: no pass of its own), and the next turn equals cold."""
    spec, plain, prompt = _hybrid_engines(arch)
    among = batched = replayed = 0
    for r in range(12):
        prompts = [[9, 3 * r + i, *prompt] for i in range(3)]
        cuts = [2 + 3 * r + i for i in range(3)]
        turns = [turn_for(spec) for _ in prompts]
        steps = [generate(spec, p, sampler=_greedy, max_tokens=40, turn=t)
                 for p, t in zip(prompts, turns, strict=True)]
        got = [[next(s)] for s in steps]
        live, company = [0, 1, 2], [False] * 3
        while live:
            runs = [turns[i].run for i in live]
            batched += len(runs) > 1
            left = dict(zip(live, spec.batch.step(runs), strict=True))
            for i in list(live):
                run = turns[i].run
                assert run is not None
                got[i].append(steps[i].send(left[i]))   # what the pass left for it
                while run.ahead and len(got[i]) < cuts[i]:
                    got[i].append(next(steps[i]))
                if len(got[i]) >= cuts[i]:
                    among += len(run.ahead) > 1   # accepted tokens nobody yielded
                    replayed += _replayed(run.spec.captured if run.spec else None)
                    # others decode on, and its last yielded token is not in the cache (it
                    # was not accepted in a verify pass): that token is not fed
                    company[i] = len(live) > 1 and not run.ahead
                    steps[i].close()
                    live.remove(i)
        for p, reply, beside in zip(prompts, got, company, strict=True):
            follow = [*p, *reply, 5]
            assert spec.cached_now(follow) == len(p) + len(reply) - beside, r
            warm = list(generate(spec, follow, sampler=_greedy, max_tokens=8))
            assert warm == list(generate(plain, follow, sampler=_greedy, max_tokens=8)), r
    assert among and batched
    assert bool(replayed) == arch.endswith("-replay")


def _replayed(captured: Captured | RowOf | None) -> bool:
    """Whether a run's last verify pass computes its states again (held nothing per draft)."""
    return bool(captured is not None and captured.replayed)


# --- the worker: sampling, log-probabilities, batches, a client leaving -------------------------
@pytest.fixture(scope="module")
def words_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("qwen3_next", tmp_path_factory.mktemp("words"), words=6)


@pytest.fixture(scope="module")
def gens(words_model: Path) -> Iterator[tuple[Generator, Generator]]:
    yield from on_and_off(words_model)


def _prompts(gen: Generator, seed: int, n: int = 3) -> list[list[int]]:
    assert gen.loaded is not None
    words = gen.loaded.tokenizer.encode(" the an some be on to", add_special_tokens=False)
    rng = random.Random(seed)
    return [[rng.choice(words) for _ in range(30 + 25 * i)] for i in range(n)]


def _submit(gen: Generator, tokens: list[int], sampling: Sampling, max_tokens: int = 48,
            namespace: str = "") -> Job:
    return gen.submit(Prompt(tokens, []), sampling, max_tokens, logprobs=0,
                      namespace=namespace)


def _spec(end: Finished) -> dict[str, int]:
    return dict((end.prefixd or {}).get("speculative") or {})


@pytest.mark.parametrize("sampling", [Sampling(temperature=0),
                                      Sampling(temperature=0.8, seed=21),
                                      Sampling(temperature=1.1, top_p=0.9, seed=5,
                                               repetition_penalty=1.2)],
                         ids=["greedy", "seeded", "seeded-penalized"])
async def test_replies_and_logprobs_with_drafts_equal_those_without(
        gens: tuple[Generator, Generator], sampling: Sampling) -> None:
    on, off = gens
    drafted = accepted = 0
    for i, p in enumerate(_prompts(on, 7)):
        got = await collect(_submit(on, p, sampling, namespace=f"a{i}"))
        want = await collect(_submit(off, p, sampling, namespace=f"a{i}"))
        assert got[0] == want[0]
        assert len(got[1]) == len(want[1]) == got[2].completion_tokens
        assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) \
            <= LOGPROB_TOLERANCE
        drafted += _spec(got[2])["drafted"]
        accepted += _spec(got[2])["accepted"]
        assert not _spec(want[2])
    assert drafted > 0 and accepted > 0


WORDS_ARRAY = {"type": "array", "items": {"enum": ["the", "an", "some", "be", "on", "to"]},
               "maxItems": 30}
LINES = {"type": "object", "properties": {
    "lines": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 6},
    "done": {"type": "boolean"}}, "required": ["lines", "done"], "additionalProperties": False}


@pytest.mark.parametrize("sampling", [Sampling(temperature=0),
                                      Sampling(temperature=0.8, seed=4)], ids=["greedy", "seeded"])
async def test_constrained_replies_with_drafts_equal_those_without(
        gens: tuple[Generator, Generator], sampling: Sampling) -> None:
    """Structured output speculates too: the grammar's mask at each position of a verify pass
    sees the drafted tokens before it as decoded, a drafted token it forbids ends the draft,
    and the positions not kept are given back to its matcher; the replies are those without
    drafts, token for token, and valid."""
    import json

    on, off = gens
    drafted = accepted = 0
    for schema in (WORDS_ARRAY, LINES):
        constrained = replace(sampling, constraint=Constraint(schema=schema))
        for i, p in enumerate(_prompts(on, 50)):
            got = await collect(_submit(on, p, constrained, max_tokens=120, namespace=f"c{i}"))
            want = await collect(_submit(off, p, constrained, max_tokens=120,
                                         namespace=f"c{i}"))
            assert got[0] == want[0]
            assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) \
                <= LOGPROB_TOLERANCE
            if got[2].finish_reason == "stop":
                json.loads(got[0])
            drafted += _spec(got[2])["drafted"]
            accepted += _spec(got[2])["accepted"]
    if sampling.temperature == 0:     # copies accepted, and drafts rejected mid-string
        assert 0 < accepted < drafted


async def test_a_client_leaving_mid_reply_leaves_a_state_the_next_request_trusts(
        gens: tuple[Generator, Generator]) -> None:
    on, off = gens
    greedy = Sampling(temperature=0)
    for cancel_after in (2, 5, 9):
        p = _prompts(on, 30 + cancel_after, 1)[0]
        gone = await collect(_submit(on, p, greedy, namespace="gone"), cancel_after)
        assert gone[2].finish_reason == "cancelled"
        again = await collect(_submit(on, p, greedy, namespace="gone"))
        cold = await collect(_submit(off, p, greedy, namespace="gone-cold"))
        assert again[0] == cold[0]
    assert not on._pending


async def test_requests_decoding_together_batch_and_reply_as_alone(
        gens: tuple[Generator, Generator]) -> None:
    on, off = gens
    greedy = Sampling(temperature=0)
    prompts = _prompts(on, 11, 4)
    alone = [await collect(_submit(off, p, greedy, namespace="alone")) for p in prompts]
    together = await asyncio.gather(*(collect(_submit(on, p, greedy, namespace="together"))
                                      for p in prompts))
    assert [t for t, _, _ in together] == [t for t, _, _ in alone]
    assert on.loaded is not None
    assert on.loaded.engine.cache_info()["batch"]["largest_decode_batch"] >= 2


async def test_the_worker_reports_drafts_in_its_header_cache_info_and_metrics(
        gens: tuple[Generator, Generator]) -> None:
    on, _ = gens
    settings = WorkerSettings(_env_file=None, use_system_blas=False)
    body = {"model": "tiny", "temperature": 0, "max_tokens": 40,
            "messages": [{"role": "user", "content": " the an some be on to" * 12}]}
    async with TestClient(TestServer(create_app(on, "tiny", settings))) as client:
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200
        reply = await resp.json()
        spec = reply["prefixd"]["speculative"]
        header = dict(part.split("=") for part in resp.headers["X-Prefixd-Decode"].split("; "))
        assert int(header["tokens"]) == reply["usage"]["completion_tokens"]
        assert int(header["drafted"]) == spec["drafted"] > 0
        assert int(header["accepted"]) == spec["accepted"]
        info = await (await client.get("/v1/cache")).json()
        assert info["speculative"]["drafted"] >= spec["drafted"]
        assert info["speculative"]["disabled_reason"] is None
        # prompt lookup drafted them all here: no draft model, no head
        assert info["speculative"]["by_source"]["lookup"]["drafted"] \
            == info["speculative"]["drafted"]
        metrics = await (await client.get("/metrics")).text()
    assert 'prefixd_worker_draft_tokens_total{outcome="drafted",source="lookup"}' in metrics
    assert "prefixd_worker_verify_passes_total" in metrics


async def test_through_the_daemon_drafts_show_in_the_header_and_on_the_status_page(
        words_model: Path, http: aiohttp.ClientSession) -> None:
    """The daemon in front of a managed worker: a non-streamed reply carries the worker's
    `X-Prefixd-Decode` header, and /status the worker's draft counts."""
    settings = Settings(_env_file=None, prefix_detect=False, backends=[
        {"name": "w", "kind": "mlx", "model": str(words_model), "models": ["t"]}])
    backend = ManagedBackend(settings.backends[0], settings)
    server = Server(make_proxy(settings, [backend]))
    await server.start("127.0.0.1", 0)
    body = {"model": "t", "temperature": 0, "max_tokens": 40,
            "messages": [{"role": "user", "content": " the an some be on to" * 12}]}
    try:
        await backend.wait_for(ProcState.READY, timeout=120)
        async with http.post(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                             json=body) as r:
            assert r.status == 200, await r.text()
            header = dict(p.split("=") for p in r.headers["X-Prefixd-Decode"].split("; "))
            reply = await r.json()
        async with http.get(f"http://127.0.0.1:{server.port}/status") as r:
            spec = (await r.json())["backends"][0]["cache"]["speculative"]
    finally:
        await server.shutdown(5.0)
    assert int(header["tokens"]) == reply["usage"]["completion_tokens"]
    assert int(header["drafted"]) > 0
    assert spec["drafted"] >= int(header["drafted"]) and spec["verify_passes"] > 0


def test_a_draft_model_drafts_where_the_context_has_nothing_to_copy() -> None:
    """A draft model (same vocabulary; any cache kind: a hybrid's goes back from its state
    where its last draft began) proposes where the lookup finds no match (as long as its
    measured cost pays: here it costs as much as the served model): with the served model's
    own weights its drafts are accepted; with another model's most are rejected; the replies
    are always the served model's."""
    rng = random.Random(5)
    prompt = [rng.randrange(3, 1000) for _ in range(80)]
    for target, draft, seed in (("qwen3", "qwen3", 0), ("qwen3_next", "llama", 3),
                                ("qwen3_next", "qwen3_next", 0), ("qwen3", "falcon_h1", 1),
                                ("falcon_h1", "gemma3_text", 2)):
        model, drafter = build_model(target), build_model(draft, seed=seed)
        want = list(generate(Engine(model, EngineConfig(cache_bytes=1 << 28,
                                                        speculative=False)),
                             prompt, sampler=_greedy, max_tokens=60))
        engine = Engine(model, EngineConfig(cache_bytes=1 << 28), draft_model=drafter)
        turn = turn_for(engine)
        got = list(generate(engine, prompt, sampler=_greedy, max_tokens=60, turn=turn))
        assert got == want, target
        assert turn.stats is not None and turn.stats.speculative is not None
        spec = turn.stats.speculative
        assert spec["model_drafted"] > 0
        if draft == target:     # its own drafts are all accepted (a lookup's may not be)
            assert spec["accepted"] >= spec["model_drafted"]
        assert engine.cache_info()["speculative"]["draft_model"] is True


def _other_vocabulary(out: Path) -> Path:
    """A tiny model folder whose tokenizer has 512 tokens (the others': TINY_VOCAB)."""
    from mlx.utils import tree_flatten

    from prefixd.backends.mlx.model import tinytok
    out.mkdir(parents=True)
    config = tiny_config("qwen3", 512)
    model = model_from_config(config)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    tinytok.save_tokenizer(tinytok.train_tokenizer(512), out)
    return out


async def test_a_worker_loads_its_draft_model_and_refuses_one_that_cannot_draft(
        tmp_path: Path) -> None:
    """A draft model of any cache kind drafts (a hybrid for a full-attention model here); one
    whose tokenizer is not the served model's is refused, and the worker serves without it."""
    served = save_tiny_model("qwen3", tmp_path / "served", words=6)
    hybrid = save_tiny_model("qwen3_next", tmp_path / "hybrid", words=6)
    other = _other_vocabulary(tmp_path / "other")
    greedy = Sampling(temperature=0)
    prompt = [random.Random(9).randrange(3, 1000) for _ in range(60)]
    off = untimed(served, speculative=False)
    try:
        want = await collect(_submit(off, prompt, greedy))
    finally:
        off.close()
    for draft, used in ((served, True), (hybrid, True), (other, False)):
        g = untimed(served, spec_draft_model=str(draft))
        try:
            assert g.loaded is not None
            assert g.loaded.engine.cache_info()["speculative"]["draft_model"] is used
            got = await collect(_submit(g, prompt, greedy))
        finally:
            g.close()
        assert got[0] == want[0]
        assert (_spec(got[2]).get("model_drafted", 0) > 0) is used


def test_a_group_speculates_as_one_process_decodes(words_model: Path) -> None:
    """A two-rank group verifies drafts on every rank in lockstep (the same drafts: sized by
    acceptance alone, never by time), alone and in a decode batch of a hybrid model, and
    replies as a one-process worker without them."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from tests.worker_process import get_json, post_json, running_worker

    def post(url: str, words: str = " the an some be on to", times: int = 12) -> dict[str, Any]:
        return post_json(url, "/v1/chat/completions", {
            "model": "tiny", "temperature": 0, "max_tokens": 48,
            "messages": [{"role": "user", "content": words * times}]}, "k")

    def cache(url: str) -> dict[str, Any]:
        return get_json(url, "/v1/cache", "k")

    several = [(" be on to the an some", 6 + 3 * i) for i in range(4)]
    with running_worker(words_model, "k", PREFIXD_SPECULATIVE="false") as one, \
            running_worker(words_model, "k",
                           PREFIXD_GROUP_HOSTS=json.dumps(["127.0.0.1", "127.0.0.1"])) as group:
        want, got = post(one), post(group)
        alone = [post(one, *a)["choices"][0]["message"] for a in several]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda a: post(group, *a)["choices"][0]["message"],
                                     several))
        info = cache(group)
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert got["prefixd"]["speculative"]["accepted"] > 0
    assert together == alone
    assert info["speculative"]["largest_verify_batch"] >= 2


# one of each cache kind a batch holds: full-attention KV, Gated-DeltaNet and Mamba states with
# their convolutions (beside attention and alone; three of them, q, k and v: olmo_hybrid),
# sliding windows (128 tokens: wrapped here). Not lfm2: its tied six-word model repeats its
# last token, whatever its convolutions hold.
BATCH_ARCHS = ("qwen3", "qwen3_next", "falcon_h1", "mamba2", "gemma3_text", "olmo_hybrid",
               "jamba")


@pytest.fixture(scope="module", params=BATCH_ARCHS)
def batch_words_model(request: pytest.FixtureRequest,
                      tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(request.param, tmp_path_factory.mktemp("batch-words"), words=6)


# Replies long enough that a batch row's masked positions pass `gapped.MAX_GAP` (64) mid-batch:
# here its gaps grow by about one position a verify pass (squeezed twice in 384 tokens).
SQUEEZING_TOKENS = 384


@pytest.mark.parametrize("sampling,tokens,capture", [
    (Sampling(temperature=0), 48, None),
    (Sampling(temperature=0.9, seed=3), 48, None),
    (Sampling(temperature=0), SQUEEZING_TOKENS, None), (Sampling(temperature=0), 48, 0)],
    ids=["greedy", "seeded", "greedy-squeezed", "greedy-replayed"])
async def test_requests_decoding_together_verify_their_drafts_in_one_batched_pass(
        batch_words_model: Path, sampling: Sampling, tokens: int, capture: int | None) -> None:
    """Every cache kind: the decode batch's pass carries every member's draft (rows padded
    to the longest), each row goes back to its last accepted token (full-attention KV masked
    where it is, windows rolled into the row's padding, recurrent states those captured there
    in the pass); the replies and log-probabilities are each request's alone without drafts,
    and their next turns warm equal cold. Squeezed: replies long enough that the masked
    positions are squeezed out of the batch mid-batch (`/v1/cache` counts the passes that
    did). Replayed: recurrent states computed again for each row where it needs them, none
    kept per drafted position."""
    on = untimed(batch_words_model, **({} if capture is None else {"spec_capture_bytes": capture}))
    off = untimed(batch_words_model, speculative=False)
    try:
        prompts = _prompts(on, 12, 4)
        alone = [await collect(_submit(off, p, sampling, tokens, namespace="a"))
                 for p in prompts]
        together = await asyncio.gather(*(collect(_submit(on, p, sampling, tokens,
                                                          namespace="b"))
                                          for p in prompts))
        assert on.loaded is not None
        info = on.loaded.engine.cache_info()
        # the states the batch left (rows rolled, then extracted and stored): next turns
        follow = []
        for p in prompts:
            held = max((e.tokens for e in on.loaded.engine.store.entries
                        if e.namespace == "b" and e.tokens[:len(p)] == p), key=len)
            assert len(held) > len(p)
            follow.append([*held, *p[:5]])
        greedy = Sampling(temperature=0)
        warm = [await collect(_submit(on, f, greedy, namespace="b")) for f in follow]
        cold = [await collect(_submit(off, f, greedy, namespace="cold")) for f in follow]
    finally:
        on.close()
        off.close()
    assert [t for t, _, _ in warm] == [t for t, _, _ in cold]
    assert all(end.cached_tokens >= len(f) - 6 for (_, _, end), f in zip(warm, follow,
                                                                        strict=True))
    assert [t for t, _, _ in together] == [t for t, _, _ in alone]
    for (_, got, _), (_, want, _) in zip(together, alone, strict=True):
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= \
            (LONG_LOGPROB_TOLERANCE if tokens > 48 else LOGPROB_TOLERANCE)
    assert info["speculative"]["largest_verify_batch"] >= 2
    assert info["speculative"]["accepted"] > 0
    # recurrent states computed again where needed, not kept per position: only when asked
    arch = json.loads((batch_words_model / "config.json").read_text())["model_type"]
    recurrent = arch not in ("qwen3", "gemma3_text")
    assert (info["speculative"]["recomputed_passes"] > 0) == (capture == 0 and recurrent)
    # the masked positions squeezed out mid-batch, where the batch's full-attention KV is its
    # own (`GappedKVCache`; falcon_h1's shares a layer with a Mamba state and is rolled back,
    # mamba2 has none)
    if tokens == SQUEEZING_TOKENS:
        assert (info["speculative"]["squeezed_passes"] > 0) == \
            (arch not in ("falcon_h1", "mamba2")), info["speculative"]
    # the longest draft: 16 where every layer trims, 8 where states are captured per position
    assert info["speculative"]["draft_max"] == (16 if arch == "qwen3" else 8)


@pytest.mark.parametrize("arch", ["qwen3_next", "olmo_hybrid", "gemma3_text"])
def test_a_draft_model_of_any_cache_kind_goes_back_to_where_its_last_draft_began(
        arch: str) -> None:
    """After the request accepted part of its draft and wrote another token, a draft model
    whose layers do not all trim (recurrent states; gemma3's windows, 48 wide: wrapped) drafts
    what a fresh copy of it drafts from the same tokens."""
    if arch == "gemma3_text":
        model = model_from_config({**tiny_config(arch), "sliding_window": 48})
    else:
        model = build_model(arch)
    restrict_output(model, ALPHABET)
    rng = random.Random(6)
    context = [rng.choice(ALPHABET) for _ in range(40)]
    drafter = ModelDrafter(model)
    went_back = 0
    for step in range(14):
        draft = drafter.propose(context, 6)
        assert draft == ModelDrafter(model).propose(context, 6), (arch, step)
        a = step % 6             # accepted, then a token of the request's own
        went_back += a < 5
        context = [*context, *draft[:a], next(t for t in ALPHABET if t != draft[a])]
    assert went_back and drafter.mark is not None
