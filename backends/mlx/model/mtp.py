"""A model's own multi-token-prediction (MTP) head, where its checkpoint carries one.

Qwen3-Next and Qwen3.5 checkpoints ship `mtp.*` weights that mlx-lm drops when it loads them:
the next token's embedding and the model's last hidden state (after its final norm), each
normed, joined and projected back to the hidden size (`fc`), one full-attention decoder layer
of the model's own kind, a norm, then the model's own output projection. From the hidden state
at position i and token i + 1 it predicts token i + 2; fed its own output and its guess, the
token after that.

Owns: finding those weights in a model folder (every `*.safetensors` in it: a Hugging Face
checkpoint's shards, or `mtp.safetensors` beside an mlx conversion, which drops them; the
main weights' files mlx-lm reads are `model*.safetensors`, so a separate file never reaches
its strict load), putting them in mlx's layout as mlx-lm's sanitize puts the model's own
layers (experts stacked into `switch_mlp` from each expert's projections or from Qwen3.5-MoE's
fused ones, the zero-centred norms shifted by one: the layouts checkpoints ship; a module
stored quantized, in mlx's layout, stacked and split with its scales and biases), and
building the head (`MTPHead`), which shares the model's embedding and output projection
(`Parts`): float, or quantized where its weights are (`mtpquant.py`), refusing weights that
do not fit it or are not all finite (`checks.py`). Nothing here decodes:
`engine/spec/mtpdraft.py` drafts with it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from prefixd.backends.mlx.model import mtpquant
from prefixd.backends.mlx.model.checks import nonfinite

log = logging.getLogger("prefixd.worker")

ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
MTP_FILE = "mtp.safetensors"   # where an mlx conversion's head goes (mlx-lm drops it)
# norms stored zero-centred in the checkpoints (weight + 1 is the scale), as mlx-lm shifts them
_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
            "k_norm.weight", "mtp.norm.weight", "pre_fc_norm_hidden.weight",
            "pre_fc_norm_embedding.weight")


class MTPHead(nn.Module):
    """The `mtp.*` modules: `(hidden, embedded next token) -> hidden` for the output projection."""

    def __init__(self, hidden_size: int, eps: float, layer: nn.Module) -> None:
        super().__init__()
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = [layer]
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, hidden: mx.array, embedded: mx.array, cache: Any) -> mx.array:
        x = mx.concatenate([self.pre_fc_norm_embedding(embedded),
                            self.pre_fc_norm_hidden(hidden)], axis=-1)
        x = self.fc(x)
        x = self.layers[0](x, mask=create_attention_mask(x, cache), cache=cache)
        return self.norm(x)


@dataclass
class Parts:
    """Where a model keeps what its MTP head shares: its text model (`inner`: embedding, layers,
    final norm) and its output projection."""

    holder: Any
    inner: Any

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def project(self, hidden: mx.array) -> mx.array:
        if "lm_head" in self.holder:
            return self.holder.lm_head(hidden)
        return self.inner.embed_tokens.as_linear(hidden)


def parts(model: Any) -> Parts | None:
    """The model's `Parts`, if it is of a kind whose checkpoints carry an MTP head."""
    holder = getattr(model, "language_model", model)   # Qwen3.5 wraps its text model
    inner = getattr(holder, "model", None)
    if getattr(model, "model_type", None) not in ARCHS and \
            getattr(holder, "model_type", None) not in ARCHS:
        return None
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "norm", "layers")):
        return None
    return Parts(holder, inner)


def model_args(model: Any) -> Any:
    return getattr(model, "language_model", model).args


def _files(folder: Path) -> list[Path]:
    """The safetensors files of `folder` that hold `mtp.` tensors (by the index when there is
    one, so a sharded checkpoint's other shards are not read)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = {f for k, f in json.loads(index.read_text())["weight_map"].items()
                 if k.startswith("mtp.")}
        found = [folder / n for n in sorted(names)]
        return found + ([folder / MTP_FILE] if (folder / MTP_FILE).is_file() else [])
    return sorted(folder.glob("*.safetensors"))


def read_weights(folder: Path) -> dict[str, mx.array]:
    """The `mtp.` tensors in `folder` (empty: none)."""
    out: dict[str, mx.array] = {}
    for f in _files(folder):
        weights = mx.load(str(f))
        assert isinstance(weights, dict)
        out.update({k: v for k, v in weights.items() if k.startswith("mtp.")})
        del weights
    return out


def sanitize(weights: dict[str, mx.array], experts: int) -> dict[str, mx.array]:
    """Checkpoint layout to the head's: `mtp.` dropped, each expert's projections stacked into
    `switch_mlp` (Qwen3-Next ships them apart, Qwen3.5-MoE fused: `experts.gate_up_proj`, its
    gate half first, and `experts.down_proj`), zero-centred norms shifted."""
    out = {k.removeprefix("mtp."): v for k, v in weights.items()}
    for layer in sorted({k.split(".")[1] for k in out if k.startswith("layers.")}):
        base, switch = f"layers.{layer}.mlp.experts", f"layers.{layer}.mlp.switch_mlp"
        for part in ("weight", "scales", "biases"):   # a quantized head stores all three
            tail = "" if part == "weight" else f".{part}"   # fused: no `.weight` suffix
            fused = out.pop(f"{base}.gate_up_proj{tail}", None)   # Qwen3.5-MoE: [E, 2I, H]
            if fused is not None:
                mid = fused.shape[-2] // 2
                out[f"{switch}.gate_proj.{part}"] = fused[..., :mid, :]
                out[f"{switch}.up_proj.{part}"] = fused[..., mid:, :]
                down = out.pop(f"{base}.down_proj{tail}", None)
                if down is not None:
                    out[f"{switch}.down_proj.{part}"] = down
            for proj in ("up_proj", "down_proj", "gate_proj"):
                keys = [f"{base}.{e}.{proj}.{part}" for e in range(experts)]
                if experts and all(k in out for k in keys):
                    out[f"{switch}.{proj}.{part}"] = mx.stack([out.pop(k) for k in keys])
    for k, v in out.items():
        if any(("mtp." + k).endswith(sfx) for sfx in _CENTRED) and v.ndim == 1:
            out[k] = v + 1.0
    return out


def new_head(model: Any) -> MTPHead:
    """A head of `model`'s shape, its weights as initialized (random); raises ValueError for a
    model of another kind."""
    found = parts(model)
    if found is None:
        raise ValueError(f"{type(model).__module__} has no MTP head of a kind prefixd knows")
    args = found.holder.args
    # any layer this process holds (a pipeline rank holds only its own: None for the others')
    held = next((layer for layer in found.inner.layers if layer is not None), None)
    if held is None:
        raise ValueError("the model holds no decoder layer to model the MTP layer on")
    # a full-attention layer of the model's own kind (its mixture of experts where it has
    # one): the index of the first full-attention layer makes one
    layer = type(held)(args, args.full_attention_interval - 1)
    return MTPHead(args.hidden_size, args.rms_norm_eps, layer)


def build_head(model: Any, weights: dict[str, mx.array],
               quantization: dict[str, Any] | None = None) -> MTPHead:
    """The head for `model` with `weights` (checkpoint layout; modules stored quantized in
    mlx's layout are read as such: `mtpquant.py`, `quantization` the model folder's config's);
    raises ValueError when they do not fit it (a tensor missing, extra or of another shape,
    a quantized one no bits and group size fit) or are not all finite."""
    head = new_head(model)
    args = model_args(model)
    dtype = cast(Parts, parts(model)).inner.norm.weight.dtype
    ready = sanitize(weights, getattr(args, "num_experts", 0) or 0)
    mtpquant.quantize(head, ready, quantization)
    try:   # floats as the model runs them; packed weights (and uint8 scales) as stored
        head.load_weights([(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v)
                           for k, v in ready.items()], strict=True)
    except ValueError as e:
        raise ValueError(f"its MTP weights do not fit the model: {e}") from e
    mx.eval(head.parameters())
    bad = nonfinite(head)   # as it will run: after the cast, which can overflow to infinity
    if bad:
        raise ValueError(f"its MTP weights are not all finite: {bad}")
    head.eval()
    return head


def load_head(model: Any, folder: str) -> tuple[MTPHead | None, str | None]:
    """The MTP head in `folder` for `model`, or None and why not (none shipped is no problem:
    None, None)."""
    path = Path(folder)
    if parts(model) is None or not path.is_dir():
        return None, None
    try:
        weights = read_weights(path)
        if not weights:
            return None, None
        return build_head(model, weights, mtpquant.folder_quantization(path)), None
    except Exception as e:    # a damaged file costs the head, not the model
        return None, str(e) or type(e).__name__


def checkpoint_weights(head: MTPHead) -> dict[str, mx.array]:
    """`head`'s weights as a checkpoint ships them (`mtp.` names, experts apart, zero-centred
    norms): what `sanitize` reads back. Tests and the tiny models write heads with it."""
    from mlx.utils import tree_flatten

    out: dict[str, mx.array] = {}
    flat = cast(dict[str, mx.array], dict(tree_flatten(head.parameters())))
    for k, v in flat.items():
        name = "mtp." + k
        if any(name.endswith(sfx) for sfx in _CENTRED) and v.ndim == 1:
            v = v - 1.0
        if ".switch_mlp." in name:
            base, proj = name.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{base}.experts.{e}.{proj}"] = v[e]
            continue
        out[name] = v
    return out
