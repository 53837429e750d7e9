"""Convert a llama-architecture GGUF file into a folder `mlx_lm.load` reads as is.

Owns: tensor renaming (llama.cpp names to mlx-lm llama module names), the `config.json`
built from GGUF metadata, and the Hugging Face tokenizer rebuilt from the GGUF vocabulary.

MLX's own GGUF reader (`mx.load`) keeps Q4_0/Q4_1/Q8_0 tensors packed as MLX affine
quantization triples (`.weight`, `.scales`, `.biases`, group size 32), so nothing is
dequantized or requantized here: the converted weights are bit for bit the GGUF's.
mlx is imported inside the functions so the proxy can import `provision` without it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, cast

# llama.cpp tensor name (after `blk.N.`) -> mlx-lm llama module path (after `model.layers.N.`)
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|scales|biases)$")
_TOP_RE = re.compile(r"^(\w+)\.(weight|scales|biases)$")
# GGUF token types (llama.cpp `llama_token_type`): 3 = control, 4 = user defined.
_ADDED_TOKEN_TYPES = {3: True, 4: False}  # type -> special
# How each `tokenizer.ggml.pre` splits text before BPE. Both use the GPT-2 byte-level regex;
# "smollm" also splits every digit on its own (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM).
_PRE_TOKENIZERS = {"smollm": True, "gpt-2": False, "default": False}


class GGUFError(ValueError):
    """The GGUF file is not one this converter can turn into an mlx-lm folder."""


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write `model.safetensors`, `config.json` and the tokenizer files into `out_dir`.

    `out_dir` must be new or empty; callers that need atomicity convert into a temporary
    folder and rename it (see `provision`).
    """
    import mlx.core as mx

    # with return_metadata: (arrays, metadata); mlx's stub gives every form `load` returns
    tensors, meta = cast(tuple[dict[str, mx.array], dict[str, Any]],
                         mx.load(str(gguf_path), return_metadata=True))
    if _meta_str(meta, "general.architecture") != "llama":
        raise GGUFError(f"{gguf_path.name}: only llama-architecture GGUF files are supported, "
                        f"this one is {_meta_str(meta, 'general.architecture')!r}")
    weights = rename_tensors(tensors)
    config = model_config(meta, weights)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer = build_tokenizer(meta)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(meta), indent=2) + "\n")


def rename_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """Map llama.cpp tensor names to mlx-lm's; an unknown tensor is an error, not dropped."""
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        if m := _BLOCK_RE.match(name):
            layer, kind, part = m.groups()
            if kind not in _BLOCK_NAMES:
                raise GGUFError(f"unknown GGUF block tensor {name!r}")
            out[f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{part}"] = value
        elif (m := _TOP_RE.match(name)) and m.group(1) in _TOP_NAMES:
            out[f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"] = value
        elif name == "rope_freqs.weight":
            continue  # llama.cpp's precomputed RoPE factors; mlx-lm computes its own
        else:
            raise GGUFError(f"unknown GGUF tensor {name!r}")
    return out


def model_config(meta: dict[str, Any], weights: dict[str, Any]) -> dict[str, Any]:
    """An mlx-lm llama `config.json` from GGUF metadata and the renamed weights."""
    def num(key: str) -> Any:
        if f"llama.{key}" not in meta:
            raise GGUFError(f"GGUF metadata lacks llama.{key}")
        value = meta[f"llama.{key}"].item()
        # float32 metadata: keep its shortest decimal form (1e-05, not 9.9999997e-06)
        return float(f"{value:.7g}") if isinstance(value, float) else value

    hidden = num("embedding_length")
    heads = num("attention.head_count")
    vocab = (num("vocab_size") if "llama.vocab_size" in meta
             else len(meta["tokenizer.ggml.tokens"]))
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": num("block_count"),
        "intermediate_size": num("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": num("attention.head_count_kv"),
        "head_dim": hidden // heads,
        "rms_norm_eps": num("attention.layer_norm_rms_epsilon"),
        "rope_theta": num("rope.freq_base") if "llama.rope.freq_base" in meta else 10000.0,
        "max_position_embeddings": num("context_length"),
        "vocab_size": vocab,
        # llama.cpp permutes Q/K rows for its interleaved ("NORM") RoPE when it writes a
        # GGUF; MLX's traditional RoPE is that same interleaved form.
        "rope_traditional": True,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": _meta_int(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta_int(meta, "tokenizer.ggml.eos_token_id"),
    }
    if quantization := quantization_config(weights):
        config["quantization"] = quantization
    return config


def quantization_config(weights: dict[str, Any]) -> dict[str, Any] | None:
    """mlx-lm's `quantization` entry: a default, plus an entry per module that differs.

    Every GGUF type MLX keeps packed uses groups of 32; bits follow from the packed width
    (32 / bits values per uint32 word) against the number of groups. Modules without
    `.scales` stay float: mlx-lm only quantizes a module whose `.scales` it finds.
    """
    per_module: dict[str, dict[str, Any]] = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            module = name.removesuffix(".scales")
            bits = weights[f"{module}.weight"].shape[-1] // scales.shape[-1]
            per_module[module] = {"group_size": 32, "bits": bits, "mode": "affine"}
    if not per_module:
        return None
    bits_seen = [q["bits"] for q in per_module.values()]
    default = max(set(bits_seen), key=bits_seen.count)
    config: dict[str, Any] = {"group_size": 32, "bits": default, "mode": "affine"}
    config.update({m: q for m, q in per_module.items() if q["bits"] != default})
    return config


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` equal to the GGUF's `gpt2`-model vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if (kind := _meta_str(meta, "tokenizer.ggml.model")) != "gpt2":
        raise GGUFError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' BPE)")
    pre = _meta_str(meta, "tokenizer.ggml.pre") or "default"
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"GGUF pre-tokenizer {pre!r} is not supported "
                        f"(known: {', '.join(sorted(_PRE_TOKENIZERS))})")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError("GGUF vocabulary has duplicate tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                     byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if _PRE_TOKENIZERS[pre] else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = meta["tokenizer.ggml.token_type"].tolist()
    tokenizer.add_special_tokens([
        AddedToken(tokens[i], special=_ADDED_TOKEN_TYPES[t], normalized=False)
        for i, t in enumerate(types) if t in _ADDED_TOKEN_TYPES])
    return tokenizer


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """`tokenizer_config.json`: special tokens and the chat template from GGUF metadata."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        i = _meta_int(meta, f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[i]

    types = meta["tokenizer.ggml.token_type"].tolist()
    config: dict[str, Any] = {
        # The generic class loads tokenizer.json exactly as written; a model-specific class
        # could rebuild its own pre-tokenizer over ours.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(_meta_int(meta, "tokenizer.ggml.add_bos_token") or False),
        "additional_special_tokens": [tokens[i] for i, t in enumerate(types) if t == 3],
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta["llama.context_length"].item(),
    }
    if template := _meta_str(meta, "tokenizer.chat_template"):
        config["chat_template"] = template
    return {k: v for k, v in config.items() if v is not None}


def _meta_str(meta: dict[str, Any], key: str) -> str | None:
    value = meta.get(key)
    return value if isinstance(value, str) else None


def _meta_int(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(key)
    return None if value is None else int(value.item())
