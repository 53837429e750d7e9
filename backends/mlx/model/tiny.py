"""Tiny random-weight models of each architecture prefixd checkpoints, for tests and benches.

Owns: the tiny `config.json` per architecture (sized to run on 2 CPU cores while still creating
each architecture's cache classes), building the mlx-lm model from it, and writing a complete
model folder (`save_tiny_model`) that `mlx_lm.load` opens with no network. The tokenizer and
chat template live in `model/tinytok.py`.

Random weights would emit arbitrary byte tokens whose text does not re-encode to the same ids,
which breaks multi-turn prefix tests for reasons unrelated to caching. So the saved lm_head is
restricted: only whole-word tokens (leading space + letters, each encoding back to itself) get
non-zero rows, scaled up so they always out-score every other token (whose rows are zero).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.nn as nn

# mlx is imported inside functions so ARCHS, tiny_config and the CLI's argument parsing work in
# processes that never load mlx (the proxy side).

ARCHS: tuple[str, ...] = ("qwen3", "gemma3_text", "qwen3_next", "qwen3_5", "falcon_h1")
# More cache kinds, built in-process by the tests that cover every kind (speculative decoding):
# plain KV (llama, gemma2: tied embeddings), Mamba2 alone, LFM2's short convolutions, OLMo
# hybrid's Gated DeltaNet after three convolutions (q, k, v: Kimi Linear's layout too), Jamba's
# Mamba (1) selective scan beside attention and experts.
EXTRA_ARCHS: tuple[str, ...] = ("llama", "gemma2", "mamba2", "lfm2", "olmo_hybrid", "jamba")

TINY_VOCAB = 1024
# Scale of the allowed lm_head rows: large enough that a word token's best logit beats the zero
# logit of every disallowed token by a wide margin, even under temperature sampling.
_WORD_ROW_SCALE = 16.0

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

_LINEAR_ATTN: dict[str, Any] = {
    # Gated-DeltaNet: 3 linear layers then 1 full-attention layer, the real Qwen3-Next/3.5 rhythm.
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}


def _arch_fields(arch: str) -> dict[str, Any]:
    if arch == "qwen3":
        return {"num_hidden_layers": 2, "rope_theta": 1_000_000.0}
    if arch == "gemma3_text":
        # Layers 0 and 2 slide (RotatingKVCache), 1 and 3 are global (KVCache).
        return {
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "sliding_window": 128,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": 16,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
        }
    if arch == "qwen3_next":
        return {
            **_LINEAR_ATTN,
            "num_experts": 0,
            "num_experts_per_tok": 0,
            "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": 0,
            "mlp_only_layers": [],
            "moe_intermediate_size": 0,
            "rope_theta": 1_000_000.0,
            "partial_rotary_factor": 0.25,
        }
    if arch == "qwen3_5":
        return {
            **_LINEAR_ATTN,
            "rope_parameters": {
                "type": "default",
                "mrope_section": [1, 1, 0],
                "rope_theta": 1_000_000.0,
                "partial_rotary_factor": 0.25,
            },
        }
    if arch == "falcon_h1":
        # Every Falcon-H1 layer runs Mamba2 and attention in parallel (CacheList of both).
        return {
            "num_hidden_layers": 2,
            "mamba_d_ssm": 128,
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_n_groups": 1,
            "mamba_chunk_size": 64,
            "rope_theta": 1_000_000.0,
        }
    return _extra_fields(arch)


def _extra_fields(arch: str) -> dict[str, Any]:
    if arch == "llama":
        return {"num_hidden_layers": 2}
    if arch == "gemma2":
        return {"num_hidden_layers": 2, "query_pre_attn_scalar": 16}
    if arch == "mamba2":
        return {"num_heads": 8, "state_size": 16, "num_hidden_layers": 2,
                "layer_norm_epsilon": 1e-5, "conv_kernel": 4, "n_groups": 1, "use_bias": False,
                "use_conv_bias": True, "time_step_limit": [0.0, float("inf")],
                "time_step_rank": "auto"}
    if arch == "lfm2":
        # short-convolution layers (ArraysCache of one conv state) and 2 attention layers
        return {"num_hidden_layers": 4, "norm_eps": 1e-5, "conv_bias": False,
                "conv_L_cache": 3, "block_dim": 64, "block_multiple_of": 16,
                "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
                "block_ff_dim": 128, "full_attn_idxs": [1, 3]}
    if arch == "olmo_hybrid":
        return {"num_hidden_layers": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4, "linear_allow_neg_eigval": True,
                "attention_bias": False}
    if arch == "jamba":
        return {"num_hidden_layers": 4, "attn_layer_offset": 1, "attn_layer_period": 2,
                "expert_layer_offset": 1, "expert_layer_period": 2, "mamba_d_conv": 4,
                "mamba_d_state": 16, "mamba_expand": 2, "num_experts": 4,
                "num_experts_per_tok": 2}
    raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS + EXTRA_ARCHS}")


def tiny_config(arch: str, vocab_size: int = TINY_VOCAB) -> dict[str, Any]:
    """A `config.json` dict that mlx-lm's model class for `arch` accepts."""
    fields = {**_COMMON, **_arch_fields(arch), "vocab_size": vocab_size}
    if arch == "qwen3_5":
        # Real Qwen3.5 checkpoints are VLM-shaped: the language model sits in text_config.
        return {
            "model_type": "qwen3_5",
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "tie_word_embeddings": False,
            "text_config": {**fields, "model_type": "qwen3_5_text"},
        }
    return {"model_type": arch, **fields}


def model_from_config(config: dict[str, Any], seed: int = 0) -> nn.Module:
    """Instantiate the mlx-lm model class named by `config["model_type"]` with random weights."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    model.eval()
    return model


def build_model(arch: str, seed: int = 0, vocab_size: int = TINY_VOCAB) -> nn.Module:
    """A random-weight tiny `arch` model, eval()'d; its output is not yet word-restricted."""
    return model_from_config(tiny_config(arch, vocab_size), seed)


def _lm_head(model: nn.Module) -> nn.Module:
    # qwen3_5 wraps its text model in `language_model`; the rest hold lm_head at the top.
    holder: Any = getattr(model, "language_model", model)   # modules' children are dynamic
    if "lm_head" in holder:
        return holder.lm_head
    # tied embeddings (gemma2, lfm2): restricting the output restricts the input too
    inner = holder.model
    return inner.embed_tokens if "embed_tokens" in inner else inner.embedding


def restrict_output(model: nn.Module, allowed_ids: list[int]) -> None:
    """Make the model emit only `allowed_ids`: their lm_head rows scaled up, all others zero."""
    import mlx.core as mx

    head = _lm_head(model)
    weight = head.weight
    mask = mx.zeros((weight.shape[0], 1), dtype=weight.dtype)
    mask[mx.array(allowed_ids)] = _WORD_ROW_SCALE
    head.weight = weight * mask
    mx.eval(head.weight)


def save_tiny_model(arch: str, out_dir: Path, seed: int = 0, words: int | None = None,
                    mtp: bool = False) -> Path:
    """Write a folder `mlx_lm.load(str(out_dir))` opens offline: config, weights, tokenizer.
    `words`: the model writes only that many word tokens (the first ones): its replies repeat
    themselves, as copying replies do (speculative decoding's tests). `mtp`: with a random
    multi-token-prediction head in `mtp.safetensors`, in the layout checkpoints ship it
    (qwen3_next, qwen3_5: `model/mtp.py`)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from prefixd.backends.mlx.model import tinytok

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tinytok.train_tokenizer(TINY_VOCAB)
    config = tiny_config(arch, TINY_VOCAB)
    model = model_from_config(config, seed)
    restrict_output(model, tinytok.word_token_ids(tokenizer)[:words])
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    if mtp:
        from prefixd.backends.mlx.model.mtp import MTP_FILE, checkpoint_weights, new_head

        head = new_head(model)
        mx.eval(head.parameters())
        mx.save_safetensors(str(out_dir / MTP_FILE), checkpoint_weights(head))
    eos_id = tokenizer.token_to_id(tinytok.EOS)
    config["eos_token_id"] = eos_id
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tinytok.save_tokenizer(tokenizer, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """`prefixd tiny-model ARCH OUT_DIR [--seed N]`: write a tiny random model folder."""
    parser = argparse.ArgumentParser(
        prog="prefixd tiny-model",
        description="Write a tiny random-weight mlx-lm model folder (for tests and benchmarks).",
    )
    parser.add_argument("arch", choices=ARCHS)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = save_tiny_model(args.arch, args.out_dir, seed=args.seed)
    print(path)
    return 0

