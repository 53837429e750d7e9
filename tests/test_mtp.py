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
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.engine.config import EngineConfig
from prefixd.backends.mlx.engine.engine import Engine
from prefixd.backends.mlx.engine.mtpdraft import MTP, MTPDrafter
from prefixd.backends.mlx.model import mtp
from prefixd.backends.mlx.model.tiny import model_from_config, save_tiny_model, tiny_config
from prefixd.backends.mlx.scheduler.generator import Generator
from tests.engine_steps import generate, turn_for
from tests.worker_fixtures import collect, on_and_off, untimed

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
               k: int) -> tuple[list[int], mx.array]:
    """The head's `k` greedy drafts after `context`, from scratch, and the keys its one layer
    holds for the pairs it was fed: the served model's hidden states over the context (a fresh
    cache), the head fed (hidden state at i, token i + 1) for every i from `first` on, then its
    own output and guess."""
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
            return drafts, keys
        out = head(out[:, -1:, :], parts.embed(token), cache)


Proposal = tuple[list[int], int, list[int], mx.array]


@pytest.fixture
def proposals(monkeypatch: pytest.MonkeyPatch) -> list[Proposal]:
    """Every draft the MTP drafters propose: (context, length, drafted, the keys its head's
    layer holds for the pairs it was fed, from where it began)."""
    seen: list[Proposal] = []
    propose = MTPDrafter.propose

    def spy(self: MTPDrafter, context: list[int], k: int) -> list[int]:
        out = propose(self, context, k)
        fed = self.cache.offset - self.guessed
        seen.append((list(context), k, list(out), self.cache.keys[..., :fed, :]))
        return out

    monkeypatch.setattr(MTPDrafter, "propose", spy)
    return seen


def _engines(arch: str) -> tuple[Any, mtp.MTPHead, Engine, Engine]:
    model = _model(arch)
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
def test_the_heads_drafts_are_its_own_from_the_served_models_hidden_states(
        arch: str, proposals: list[Proposal]) -> None:
    """Alone and in a decode batch, every draft equals the head's fed from scratch with the
    served model's hidden states at every position from where the request's last prefill pass
    began (what the head sees of the prompt) and the tokens after them; the replies are those
    without speculation."""
    model, head, on, off = _engines(arch)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(40 + 9 * i)] for i in range(3)]
    firsts: dict[tuple[int, ...], int] = {}   # where each prompt's last prefill pass began

    def began(p: list[int], turn: Any) -> None:
        assert turn.stats is not None
        firsts[tuple(p)] = len(p) - turn.stats.segments[-1][0]

    for p in prompts:       # alone
        turn = turn_for(on)
        got = list(generate(on, p, sampler=_greedy, max_tokens=40, turn=turn))
        assert got == list(generate(off, p, sampler=_greedy, max_tokens=40))
        assert turn.stats is not None and turn.stats.speculative is not None
        assert turn.stats.speculative["model_drafted"] > 0
        began(p, turn)
    together = [[9, *p] for p in prompts]
    turns = [turn_for(on) for _ in together]
    steps = [generate(on, p, sampler=_greedy, max_tokens=30, turn=t)
             for p, t in zip(together, turns, strict=True)]
    got = [[next(s)] for s in steps]
    batched = len(proposals)
    for _ in range(29):
        runs = [t.run for t in turns]
        on.batch.step(runs)
        for s, out, run in zip(steps, got, runs, strict=True):
            out.append(next(s))
            while run is not None and run.ahead and len(out) < 30:
                out.append(next(s))
    for s, p, t in zip(steps, together, turns, strict=True):
        s.close()
        began(p, t)
    for p, out in zip(together, got, strict=True):
        assert out[:30] == list(generate(off, p, sampler=_greedy, max_tokens=30))
    assert len(proposals) > batched > 3
    for context, k, drafted, keys in proposals:
        first = next(f for p, f in firsts.items() if tuple(context[:len(p)]) == p)
        want, want_keys = _reference(model, head, context, first, k)
        assert drafted == want, (len(context), k)
        # every pair it was fed, each position's own hidden state and token
        assert keys.shape == want_keys.shape
        assert mx.allclose(keys, want_keys, atol=1e-4).item(), (len(context), k)


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


def test_a_drafter_not_drafting_for_long_keeps_a_bounded_span(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hidden states kept one pass at a time, a verify pass's rejected positions replaced by the
    next pass's: past `HELD` positions since its last draft the drafter keeps the latest ones and
    its draft is the head's fed from there."""
    monkeypatch.setattr(MTPDrafter, "HELD", 16)
    model = _model("qwen3_next")
    head = mtp.new_head(model)
    mx.eval(head.parameters())
    parts = mtp.parts(model)
    assert parts is not None
    rng = random.Random(3)
    context = [rng.randrange(3, 1000) for _ in range(60)]
    hidden = parts.inner(mx.array(context[:59])[None], cache=make_prompt_cache(model))[0]
    drafter = MTPDrafter(MTP(head, parts))
    for pos in range(0, 50):
        drafter.saw(pos, hidden[None, pos:pos + 1])
    drafter.saw(50, mx.zeros((2, 5, hidden.shape[1])), 1)   # a verify pass, later rejected
    drafter.saw(50, hidden[None, 50:59])
    assert drafter.held <= 16
    assert drafter.propose(context, 3) == _reference(model, head, context, 59 - 16, 3)[0]
