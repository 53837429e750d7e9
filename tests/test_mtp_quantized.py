"""An MTP head stored in mlx's quantized layout (issue 51): packed uint32 weights with their
scales and biases, as quantized conversions ship it, read with the bits and group size of the
model folder's config (its per-path overrides too) or, where the config says nothing of it, as
the stored shapes imply; what cannot load is refused with its reason. The tiny models' heads
are random (`test_mtp.py`): the replies are the served model's whatever the head proposes."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, quantize_model

from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.model import mtp
from prefixd.backends.mlx.model.tiny import model_from_config, save_tiny_model, tiny_config
from prefixd.backends.mlx.scheduler.generator import Generator
from tests.worker_fixtures import collect, on_and_off, untimed

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "shared_expert_intermediate_size": 32}
# how the tests store the head: 4 bits in groups of 32, `fc` at 8 bits in groups of 64, the
# MLP's down projection at 6 bits, the query projection left float
OWN = {"fc": {"group_size": 64, "bits": 8}, "layers.0.mlp.down_proj": {"group_size": 32,
                                                                       "bits": 6}}
FLOAT = "layers.0.self_attn.q_proj"


def _quantize_head(head: nn.Module) -> None:
    nn.quantize(head, 32, 4, class_predicate=lambda p, m: hasattr(m, "to_quantized") and
                p != FLOAT and OWN.get(p, True))


def _model(arch: str, **over: Any) -> Any:
    config = tiny_config(arch)
    (config["text_config"] if arch == "qwen3_5" else config).update(over)
    return model_from_config(config)


@pytest.mark.parametrize("arch,over,fused", [("qwen3_next", {}, False),
                                             ("qwen3_next", MOE, False),
                                             ("qwen3_next", MOE, True), ("qwen3_5", {}, False)],
                         ids=["qwen3_next", "moe", "moe-fused", "qwen3_5"])
def test_a_quantized_head_loads_as_it_was_stored(arch: str, over: dict, fused: bool) -> None:
    """The head quantized (experts apart as Qwen3-Next ships them, or fused as Qwen3.5-MoE:
    each quantized with its scales and biases) reads back module for module: the same kinds,
    bits and group sizes, the same packed words, scales and biases, from the shapes alone and
    from a config that says so."""
    model = _model(arch, **over)
    head = mtp.new_head(model)
    _quantize_head(head)
    mx.eval(head.parameters())
    shipped = mtp.checkpoint_weights(head)
    if fused:
        base = "mtp.layers.0.mlp.experts"
        for part, tail in (("weight", ""), ("scales", ".scales"), ("biases", ".biases")):
            apart = {p: mx.stack([shipped.pop(f"{base}.{e}.{p}.{part}") for e in range(4)])
                     for p in ("gate_proj", "up_proj", "down_proj")}
            shipped[f"{base}.gate_up_proj{tail}"] = mx.concatenate(
                [apart["gate_proj"], apart["up_proj"]], axis=-2)
            shipped[f"{base}.down_proj{tail}"] = apart["down_proj"]
    mine = dict(tree_flatten(head.parameters()))
    config = {"group_size": 32, "bits": 4, "mode": "affine",
              **{"mtp." + p: a for p, a in OWN.items()}, "mtp." + FLOAT: False}
    for quantization in (None, config):
        built = mtp.build_head(model, shipped, quantization)
        flat = dict(tree_flatten(built.parameters()))
        assert flat.keys() == mine.keys()
        assert all(mx.array_equal(flat[k], mine[k]).item() for k in mine)
        assert isinstance(built.fc, nn.QuantizedLinear) and built.fc.bits == 8
        assert type(built.layers[0].self_attn.q_proj) is nn.Linear


def test_what_cannot_load_is_refused_with_its_reason() -> None:
    """Only what cannot run is refused: shapes no bits and group size fit, a packed weight
    without its scales, affine scales without biases, another library's layout (GPTQ)."""
    model = _model("qwen3_next")
    head = mtp.new_head(model)
    _quantize_head(head)
    mx.eval(head.parameters())
    shipped = mtp.checkpoint_weights(head)
    k = "mtp.layers.0.self_attn.k_proj"
    three = mx.concatenate([shipped[f"{k}.scales"]] * 2, axis=-1)[:, :3]   # 3 groups of 64
    cases = {"no bits and group size": {**shipped, f"{k}.scales": three},
             "without scales": {q: v for q, v in shipped.items() if q != f"{k}.scales"},
             "without its biases": {q: v for q, v in shipped.items() if q != f"{k}.biases"},
             "GPTQ": {**shipped, f"{k}.qweight": mx.zeros((8, 8), dtype=mx.int32)}}
    for why, weights in cases.items():
        with pytest.raises(ValueError, match=why):
            mtp.build_head(model, weights)


def _quantized_head_file(folder: Path, quantization: dict[str, Any] | None) -> None:
    """`folder`'s float head (`mtp.safetensors`, checkpoint layout) stored quantized as a
    conversion stores it: each projection's `weight` packed, its `scales` and `biases`
    beside it (`OWN`'s bits and group sizes, `FLOAT` left float), the norms as they were."""
    stored = mx.load(str(folder / mtp.MTP_FILE))
    assert isinstance(stored, dict)
    out: dict[str, mx.array] = {}
    for name, v in stored.items():
        path = name.removeprefix("mtp.").removesuffix(".weight")
        if v.ndim != 2 or path == FLOAT:
            out[name] = v
            continue
        own = OWN.get(path, {"group_size": 32, "bits": 4})
        out[name], scales, biases = mx.quantize(v, own["group_size"], own["bits"])
        out[f"mtp.{path}.scales"], out[f"mtp.{path}.biases"] = scales, biases
    mx.save_safetensors(str(folder / mtp.MTP_FILE), out)
    if quantization is not None:
        config = json.loads((folder / "config.json").read_text())
        overrides = {"mtp." + p: a for p, a in OWN.items()}
        config["quantization"] = {**config["quantization"], **overrides, "mtp." + FLOAT: False}
        config["quantization_config"] = config["quantization"]
        (folder / "config.json").write_text(json.dumps(config))


def _converted(folder: Path) -> dict[str, Any]:
    """`folder`'s model quantized as `mlx_lm.convert -q --q-group-size 32` writes it (its
    weights and config.json's `quantization`): what Mac users download."""
    model, config = load_model(folder)
    model, quantized = quantize_model(model, config, 32, 4)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    on_disk = json.loads((folder / "config.json").read_text())
    on_disk["quantization"] = on_disk["quantization_config"] = quantized["quantization"]
    (folder / "config.json").write_text(json.dumps(on_disk))
    return dict(quantized["quantization"])


@pytest.fixture(scope="module", params=["config", "shapes"])
def quantized_model(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_next folder with its MTP head stored quantized: with the model quantized
    too and config.json saying how (`config`), or the model float and the config silent
    (`shapes`: the head alone quantized)."""
    folder = save_tiny_model("qwen3_next", tmp_path_factory.mktemp("mtpq"), words=3, mtp=True)
    _quantized_head_file(folder, _converted(folder) if request.param == "config" else None)
    return folder


def _prompts(gen: Generator) -> list[list[int]]:
    assert gen.loaded is not None
    words = gen.loaded.tokenizer.encode(" the an some be on to", add_special_tokens=False)
    rng = random.Random(11)
    return [[rng.choice(words) for _ in range(20 + 17 * i)] for i in range(4)]


async def test_a_quantized_head_drafts_and_the_replies_are_the_served_models(
        quantized_model: Path) -> None:
    """The worker reads the quantized head (quantized modules as stored, none refused), it
    drafts, and every greedy reply, and the next turns (warm), equal a worker's without
    speculation (cold)."""
    greedy = Sampling(temperature=0)
    gens = on_and_off(quantized_model)
    on, off = next(gens)
    try:
        assert on.loaded is not None
        spec = on.loaded.engine.cache_info()["speculative"]
        assert spec["mtp"] is True and spec["refused"] == {}
        assert on.loaded.engine.spec is not None and on.loaded.engine.spec.mtp is not None
        head = on.loaded.engine.spec.mtp.head
        assert isinstance(head.fc, nn.QuantizedLinear) and head.fc.bits == 8
        assert isinstance(head.layers[0].mlp.down_proj, nn.QuantizedLinear)
        assert head.layers[0].mlp.down_proj.bits == 6
        assert type(head.layers[0].self_attn.q_proj) is nn.Linear

        def job(gen: Generator, tokens: list[int], ns: str) -> Any:
            return gen.submit(Prompt(tokens, []), greedy, 40, logprobs=None, namespace=ns)

        prompts = _prompts(on)
        drafted = 0
        replies = []
        for p in prompts:
            assert on.loaded.engine.spec is not None
            on.loaded.engine.spec.standing.rate = None   # each from the prior
            got, want = await collect(job(on, p, "a")), await collect(job(off, p, "a"))
            assert got[0] == want[0]
            drafted += dict((got[2].prefixd or {}).get("speculative") or {})["model_drafted"]
            replies.append(got[0])
        assert drafted > 0
        for p, text in zip(prompts, replies, strict=True):
            follow = [*p, *on.loaded.tokenizer.encode(text, add_special_tokens=False), *p[:4]]
            warm, cold = await collect(job(on, follow, "a")), await collect(job(off, follow, "c"))
            assert warm[0] == cold[0]
    finally:
        next(gens, None)


def test_a_head_that_cannot_load_is_refused_and_the_model_served(tmp_path: Path) -> None:
    """A quantized head whose shapes no bits and group size fit: `refused` names why, and the
    worker serves without it."""
    folder = save_tiny_model("qwen3_next", tmp_path / "m", words=3, mtp=True)
    _quantized_head_file(folder, None)
    stored = mx.load(str(folder / mtp.MTP_FILE))
    assert isinstance(stored, dict)
    stored["mtp.fc.scales"] = mx.concatenate([stored["mtp.fc.scales"]] * 2, axis=-1)[:, :3]
    mx.save_safetensors(str(folder / mtp.MTP_FILE), stored)
    gen = untimed(folder)
    try:
        assert gen.loaded is not None
        spec = gen.loaded.engine.cache_info()["speculative"]
        assert spec["mtp"] is False
        assert "fc is stored as" in spec["refused"]["mtp"]["reason"]
    finally:
        gen.close()
