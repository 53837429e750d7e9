"""A model's own multi-token-prediction head as speculative decoding's drafter (issue 36's
stretch): the head's weights read from the checkpoint layout, its drafts those of the head fed
the served model's hidden states from scratch, the replies the served model's.

The tiny models carry random heads (no model with a trained one is available offline): their
drafts are mostly rejected, which exercises going back as much as accepting does."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.engine.config import EngineConfig
from prefixd.backends.mlx.engine.engine import Engine
from prefixd.backends.mlx.engine.spec.mtpdraft import MTP, MTPDrafter
from prefixd.backends.mlx.model import mtp
from prefixd.backends.mlx.model.tiny import (
    model_from_config,
    restrict_output,
    save_tiny_model,
    tiny_config,
)
from prefixd.backends.mlx.scheduler.generator import Generator
from tests.engine_steps import generate, turn_for
from tests.worker_fixtures import collect, on_and_off, untimed

WORDS = [5, 6, 7, 8]
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "shared_expert_intermediate_size": 32}


def _model(arch: str, **over: Any) -> Any:
    config = tiny_config(arch)
    if arch == "qwen3_5":
        config["text_config"].update(over)
    else:
        config.update(over)
    return model_from_config(config)


def _greedy(lp: mx.array) -> mx.array:
    return mx.argmax(lp, axis=-1)


@pytest.mark.parametrize("arch,over", [("qwen3_next", {}), ("qwen3_next", MOE),
                                       ("qwen3_5", {})], ids=["qwen3_next", "moe", "qwen3_5"])
def test_a_checkpoints_mtp_weights_load_into_the_head(arch: str, over: dict) -> None:
    """The layouts checkpoints ship (`mtp.` names, each expert's projections apart or fused
    as Qwen3.5-MoE's, zero-centred norms) are read into the head as mlx-lm reads the model's
    own layers."""
    model = _model(arch, **over)
    head = mtp.new_head(model)
    mx.eval(head.parameters())
    shipped = mtp.checkpoint_weights(head)
    assert all(k.startswith("mtp.") for k in shipped)
    mine = dict(tree_flatten(head.parameters()))
    # zero-centred as shipped: the scale is weight + 1
    assert mx.array_equal(shipped["mtp.norm.weight"] + 1, mine["norm.weight"]).item()
    assert mx.array_equal(shipped["mtp.pre_fc_norm_hidden.weight"] + 1,
                          mine["pre_fc_norm_hidden.weight"]).item()
    if over:
        assert "mtp.layers.0.mlp.experts.3.up_proj.weight" in shipped
        assert mx.array_equal(shipped["mtp.layers.0.mlp.experts.2.down_proj.weight"],
                              mine["layers.0.mlp.switch_mlp.down_proj.weight"][2]).item()
    layouts = [shipped]
    if over:    # Qwen3.5-MoE ships its experts fused: gate and up in one, its gate half first
        base = "mtp.layers.0.mlp.experts"
        apart = {p: mx.stack([shipped[f"{base}.{e}.{p}.weight"] for e in range(4)])
                 for p in ("gate_proj", "up_proj", "down_proj")}
        fused = {k: v for k, v in shipped.items() if ".experts." not in k}
        fused[f"{base}.gate_up_proj"] = mx.concatenate([apart["gate_proj"], apart["up_proj"]],
                                                       axis=-2)
        fused[f"{base}.down_proj"] = apart["down_proj"]
        layouts.append(fused)
    for layout in layouts:
        built = dict(tree_flatten(mtp.build_head(model, layout).parameters()))
        assert built.keys() == mine.keys()
        assert all(mx.allclose(built[k], mine[k]).item() for k in mine)
    with pytest.raises(ValueError, match="do not fit"):     # another model's head
        mtp.build_head(model, {**shipped, "mtp.fc.weight": mx.zeros((8, 8))})


def _reference(model: Any, head: mtp.MTPHead, context: list[int], first: int,
               k: int, guesses: bool = False) -> tuple[list[int], mx.array]:
    """The head's `k` greedy drafts after `context`, from scratch, and the keys its one layer
    holds for the pairs it was fed (with `guesses`, and for its guesses fed back): the served
    model's hidden states over the context (a fresh cache), the head fed (hidden state at i,
    token i + 1) for every i from `first` on, then its own output and guess."""
    parts = mtp.parts(model)
    assert parts is not None
    end = len(context) - 1
    hidden = parts.inner(mx.array(context[:end])[None], cache=make_prompt_cache(model))
    cache = KVCache()
    out = head(hidden[:, first:end], parts.embed(mx.array(context[first + 1:end + 1])[None]),
               cache)
    keys = cache.keys[..., :end - first, :]
    drafts: list[int] = []
    while True:
        token = mx.argmax(parts.project(out[:, -1:, :]), axis=-1)
        drafts.append(int(token.item()))
        if len(drafts) == k:
            return drafts, cache.keys[..., :cache.offset, :] if guesses else keys
        out = head(out[:, -1:, :], parts.embed(token), cache)


class Proposal(NamedTuple):
    context: list[int]      # the request's tokens it drafted after
    k: int                  # the draft's length
    keys: mx.array          # its head's layer's: every pair it was fed, then every guess
    verified: int           # the draft's tokens its verify pass checked (a batch may cut it)
    accepted: int           # of those, the ones equal to the served model's


class Drafts:
    """Every draft the requests' MTP heads proposed, read off each request's drafter after
    each of its steps: a step drafts at most once, and its drafter's head cache holds what it
    was fed and guessed until its next draft (`MTPDrafter.next`: the position drafted after)."""

    def __init__(self) -> None:
        self.seen: list[Proposal] = []
        self._last: dict[int, tuple[MTPDrafter, int, int, int]] = {}

    def look(self, turn: Any) -> None:
        run = turn.run
        spec = run.spec if run is not None else None
        drafter = spec.model if spec is not None else None
        if not isinstance(drafter, MTPDrafter) or not drafter.next:   # none, or let go
            return
        _, at, drafted, accepted = self._last.get(id(drafter), (drafter, 0, 0, 0))
        self._last[id(drafter)] = (drafter, drafter.next, spec.model_drafted,
                                   spec.model_accepted)
        if drafter.next != at:
            keys = drafter.cache.keys[..., :drafter.cache.offset, :]
            mx.eval(keys)
            self.seen.append(Proposal((run.prompt + run.fed)[:drafter.next + 1],
                                      drafter.passes, keys, spec.model_drafted - drafted,
                                      spec.model_accepted - accepted))


def _engines(arch: str, words: list[int] | None = None
             ) -> tuple[Any, mtp.MTPHead, Engine, Engine]:
    """The served model (writing only `words`, if given: its head, which shares its output
    projection, then guesses right now and then), its head, and engines with and without it."""
    model = _model(arch)
    if words is not None:
        restrict_output(model, words)
    head = mtp.new_head(model)
    mx.eval(head.parameters())
    parts = mtp.parts(model)
    assert parts is not None
    on = Engine(model, EngineConfig(cache_bytes=1 << 28), mtp=MTP(head, parts))
    assert on.spec is not None
    on.spec.costs.timed = False     # drafts by acceptance alone, never by time
    off = Engine(model, EngineConfig(cache_bytes=1 << 28, speculative=False))
    return model, head, on, off


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_the_heads_drafts_are_its_own_from_the_served_models_hidden_states(arch: str) -> None:
    """Alone and in a decode batch, every draft equals the head's fed from scratch with the
    served model's hidden states at every position from where the request's last prefill pass
    began (what the head sees of the prompt) and the tokens after them; the replies are those
    without speculation. Each draft is read off its request's drafter (what its head was fed
    and guessed) and off its verify pass (how many of its tokens the served model drew: the
    model writes four tokens, so the head's guesses are right now and then)."""
    model, head, on, off = _engines(arch, WORDS)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(40 + 9 * i)] for i in range(3)]
    firsts: dict[tuple[int, ...], int] = {}   # where each prompt's last prefill pass began
    replies: dict[tuple[int, ...], list[int]] = {}
    drafts = Drafts()

    def began(p: list[int], turn: Any) -> None:
        assert turn.stats is not None
        firsts[tuple(p)] = len(p) - turn.stats.segments[-1][0]

    assert on.spec is not None
    for p in prompts:       # alone
        on.spec.standing.rate = None   # each from the prior, not the last one's misses
        turn = turn_for(on)
        got = []
        for token in generate(on, p, sampler=_greedy, max_tokens=40, turn=turn):
            got.append(token)
            drafts.look(turn)
        assert got == list(generate(off, p, sampler=_greedy, max_tokens=40))
        assert turn.stats is not None and turn.stats.speculative is not None
        assert turn.stats.speculative["model_drafted"] > 0
        began(p, turn)
        replies[tuple(p)] = got
    together = [[9, *p] for p in prompts]
    on.spec.standing.rate = None
    turns = [turn_for(on) for _ in together]
    steps = [generate(on, p, sampler=_greedy, max_tokens=30, turn=t)
             for p, t in zip(together, turns, strict=True)]
    got = [[next(s)] for s in steps]
    batched = len(drafts.seen)
    while live := [i for i, out in enumerate(got) if len(out) < 30]:
        left = on.batch.step([turns[i].run for i in live])
        for i, fed in zip(live, left, strict=True):
            drafts.look(turns[i])
            got[i].append(steps[i].send(fed))
            while (run := turns[i].run) is not None and run.ahead and len(got[i]) < 30:
                got[i].append(next(steps[i]))
            drafts.look(turns[i])
    for s, p, t in zip(steps, together, turns, strict=True):
        s.close()
        began(p, t)
    for p, out in zip(together, got, strict=True):
        assert out[:30] == list(generate(off, p, sampler=_greedy, max_tokens=30))
        replies[tuple(p)] = out[:30]
    assert len(drafts.seen) > batched > 3
    assert sum(d.accepted for d in drafts.seen) > 0
    for d in drafts.seen:
        p = next(p for p in firsts if tuple(d.context[:len(p)]) == p)
        want, want_keys = _reference(model, head, d.context, firsts[p], d.k, guesses=True)
        # every pair it was fed, each position's own hidden state and token, and its guesses
        # fed back (its draft but the last token)
        assert d.keys.shape == want_keys.shape, (len(d.context), d.k)
        assert mx.allclose(d.keys, want_keys, atol=1e-4).item(), (len(d.context), d.k)
        # the draft as verified: its accepted tokens those of the head's that equal the reply
        reply = [*p, *replies[p]][len(d.context):len(d.context) + d.verified]
        differ = (i for i, (a, b) in enumerate(zip(want[:d.verified], reply, strict=True))
                 if a != b)
        assert d.accepted == next(differ, d.verified), (len(d.context), d.k)


def test_a_draft_cut_before_its_verify_pass_is_not_counted() -> None:
    """A decode batch cuts drafts to a fair width before its pass (some to nothing): a request
    counts the head's drafted tokens when they are verified, as the worker's totals do."""
    _, _, on, _ = _engines("qwen3_next")
    rng = random.Random(4)
    turn = turn_for(on)
    steps = generate(on, [rng.randrange(3, 1000) for _ in range(40)], sampler=_greedy,
                     max_tokens=10, turn=turn)
    next(steps)
    run = turn.run
    assert run is not None and run.spec is not None and run.pending is not None
    assert run.spec.draft(run, run.pending, 8)          # proposed, then never verified
    assert run.spec.info()["model_drafted"] == 0
    steps.close()


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("qwen3_next", tmp_path_factory.mktemp("mtp"), words=3, mtp=True)


@pytest.fixture(scope="module")
def gens(mtp_model: Path) -> Iterator[tuple[Generator, Generator]]:
    yield from on_and_off(mtp_model)


def _prompts(gen: Generator, n: int = 4) -> list[list[int]]:
    assert gen.loaded is not None
    words = gen.loaded.tokenizer.encode(" the an some be on to", add_special_tokens=False)
    rng = random.Random(11)
    return [[rng.choice(words) for _ in range(20 + 17 * i)] for i in range(n)]


async def test_a_worker_drafts_with_the_head_its_model_folder_ships(
        gens: tuple[Generator, Generator]) -> None:
    """A model folder with `mtp.safetensors` beside the weights mlx-lm loads: the worker
    drafts with that head (`/v1/cache` says so), alone and four at once, and every reply,
    log-probabilities too, and the next turns are those of a worker without speculation."""
    on, off = gens
    assert on.loaded is not None
    assert on.loaded.engine.cache_info()["speculative"]["mtp"] is True
    prompts = _prompts(on)
    greedy = Sampling(temperature=0)

    def job(gen: Generator, tokens: list[int], ns: str) -> Any:
        return gen.submit(Prompt(tokens, []), greedy, 40, logprobs=0, namespace=ns)

    want = [await collect(job(off, p, "a")) for p in prompts]
    alone = [await collect(job(on, p, "a")) for p in prompts]
    together = await asyncio.gather(*(collect(job(on, p, "b")) for p in prompts))
    for (text, lps, _), (w_text, w_lps, _) in zip([*alone, *together], want * 2,
                                                    strict=True):
        assert text == w_text
        assert max(abs(a - b) for a, b in zip(lps, w_lps, strict=True)) <= 1e-4
    drafted = [dict((end.prefixd or {}).get("speculative") or {}).get("model_drafted", 0)
               for _, _, end in [*alone, *together]]
    assert sum(drafted) > 0
    accepted = sum(dict((end.prefixd or {}).get("speculative") or {})["model_accepted"]
                   for _, _, end in [*alone, *together])
    # the worker's totals by who drafted: the head's are the requests' own
    by_source = on.loaded.engine.cache_info()["speculative"]["by_source"]
    assert by_source["mtp"] == {"drafted": sum(drafted), "accepted": accepted}
    follow = [[*p, *on.loaded.tokenizer.encode(t, add_special_tokens=False), *p[:4]]
              for p, (t, _, _) in zip(prompts, alone, strict=True)]
    for f in follow:
        warm, cold = await collect(job(on, f, "a")), await collect(job(off, f, "c"))
        assert warm[0] == cold[0]


def test_a_head_is_used_only_where_it_fits_and_is_asked_for(
        mtp_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`spec_mtp` false: no head. A head of another model's shape, or a damaged file: logged,
    not used, the model served without it."""
    plain = untimed(mtp_model, spec_mtp=False)
    try:
        assert plain.loaded is not None
        assert plain.loaded.engine.cache_info()["speculative"]["mtp"] is False
    finally:
        plain.close()
    other = save_tiny_model("qwen3_next", tmp_path / "other", words=3)
    wide = _model("qwen3_next", hidden_size=32, head_dim=8, linear_key_head_dim=8,
                  linear_value_head_dim=8)
    head = mtp.new_head(wide)
    mx.eval(head.parameters())
    mx.save_safetensors(str(other / mtp.MTP_FILE), mtp.checkpoint_weights(head))
    damaged = save_tiny_model("qwen3_next", tmp_path / "damaged", words=3)
    (damaged / mtp.MTP_FILE).write_bytes(b"\xff" * 64)
    for folder, why in ((other, "do not fit"), (damaged, "header")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="prefixd.worker"):
            gen = untimed(folder)
        try:
            assert gen.loaded is not None
            assert gen.loaded.engine.cache_info()["speculative"]["mtp"] is False
            assert any("MTP head is not used" in r.getMessage() and why in r.getMessage()
                       for r in caplog.records), why
        finally:
            gen.close()


def test_a_drafter_not_drafting_for_long_keeps_a_bounded_span() -> None:
    """Hidden states kept one pass at a time, a verify pass's rejected positions replaced by the
    next pass's: past `HELD` positions since its last draft (here 59 more) the drafter keeps
    the latest ones and its draft is the head's fed from there."""
    model = _model("qwen3_next")
    head = mtp.new_head(model)
    mx.eval(head.parameters())
    parts = mtp.parts(model)
    assert parts is not None
    held = MTPDrafter.HELD
    seen = held + 50     # positions seen one pass each, then a verify pass's 9
    end = seen + 9
    rng = random.Random(3)
    context = [rng.randrange(3, 1000) for _ in range(end + 1)]
    hidden = parts.inner(mx.array(context[:end])[None], cache=make_prompt_cache(model))[0]
    drafter = MTPDrafter(MTP(head, parts))
    for pos in range(seen):
        drafter.saw(pos, hidden[None, pos:pos + 1])
    drafter.saw(seen, mx.zeros((2, 5, hidden.shape[1])), 1)   # a verify pass, later rejected
    drafter.saw(seen, hidden[None, seen:end])
    assert drafter.held == held
    want, want_keys = _reference(model, head, context, end - held, 3)
    assert drafter.propose(context, 3) == want
    # the head was fed the latest `held` positions' pairs, each its own
    keys = drafter.cache.keys[..., :drafter.cache.offset - drafter.guessed, :]
    assert keys.shape == want_keys.shape
    assert mx.allclose(keys, want_keys, atol=1e-4).item()
