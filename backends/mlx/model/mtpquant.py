"""An MTP head stored in mlx's quantized layout, as quantized conversions ship it.

A quantized module of a checkpoint is stored as mlx's `nn.quantize` leaves it: its `weight`
packed into uint32 words (32 / bits values each), its `scales` (and, in the affine mode, its
`biases`) one per group of `group_size` input values. Such a head is read as mlx-lm reads a
quantized model: every module whose `scales` are stored becomes its quantized kind
(`nn.QuantizedLinear`, `QuantizedSwitchLinear` for the experts) before the weights load.

Owns: how each module of the head is quantized (`plan`): the bits and group size of the model
folder's config (`quantization`, else `quantization_config`: the path's own override, else the
top level) where they fit the stored shapes, else the pair the shapes imply (the weight's
columns x 32 / bits = the scales' columns x group size = the input size the head's module
needs: one pair fits); the mode from the config, else as the stored dtypes imply (affine where
the scales are floats, which needs biases; for uint8 scales the one mode of those bits and
group size, as mlx-lm infers it). And refusing, with the reason, what cannot load: a packed
weight without scales, shapes no pair fits, bits this mlx does not quantize, another library's
quantized layout (AWQ, GPTQ, FP8's scales). `store_quantized` writes a float head file
quantized as a conversion would (the bench's quantized head).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# where a conversion that keeps the head names its modules (the head's own path after these)
PREFIXES = ("mtp.", "language_model.mtp.", "model.mtp.")
# another library's quantized layouts: not mlx's, not read
FOREIGN = (".qweight", ".qzeros", ".g_idx", ".weight_scale", ".weight_scale_inv",
           ".input_scale")
# the modes other than affine keep uint8 scales and allow one (bits, group size) each
_MODES = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}


def folder_quantization(folder: Path) -> dict[str, Any] | None:
    """The quantization `folder`'s config.json declares, in mlx's form (`group_size`, `bits`,
    `mode`, per-path overrides), or None: none, or one of another library (its tensors are
    then refused by name, `foreign`)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or {}
    for found in (config.get("quantization"), text.get("quantization"),
                  config.get("quantization_config"), text.get("quantization_config")):
        if not isinstance(found, dict):
            continue
        if "bits" in found or "group_size" in found:
            return found
        method = found.get("quant_method")
        if method in ("mxfp4", "mxfp8"):
            return {"group_size": 32, "bits": 4 if method == "mxfp4" else 8, "mode": method}
    return None


def foreign(weights: dict[str, mx.array]) -> str | None:
    """Why `weights` are in a quantized layout mlx does not read (None: they are not)."""
    odd = sorted(k for k in weights if k.endswith(FOREIGN))
    if not odd:
        return None
    return (f"its MTP weights are quantized in a layout mlx does not read ({odd[0]}: AWQ, "
            "GPTQ or FP8 scales; a conversion to mlx stores weight, scales and biases)")


def _declared(config: dict[str, Any] | None, path: str) -> dict[str, Any] | None:
    """What the config says of the head's module `path`: its own override (False: none),
    else the top level."""
    if not config:
        return None
    for prefix in PREFIXES:
        own = config.get(prefix + path)
        if own is False:
            return None
        if isinstance(own, dict):
            return own
    return config if "bits" in config and "group_size" in config else None


def _implied(path: str, weight: mx.array, scales: mx.array, in_dims: int) -> tuple[int, int]:
    """The (bits, group size) the stored shapes imply for a module of `in_dims` inputs."""
    cols, groups = weight.shape[-1], scales.shape[-1]
    if groups <= 0 or in_dims % groups or (cols * 32) % in_dims:
        raise ValueError(f"its MTP weights do not fit the model: {path} is stored as "
                         f"{tuple(weight.shape)} packed words with {tuple(scales.shape)} "
                         f"scales, which no bits and group size make {in_dims} inputs")
    return (cols * 32) // in_dims, in_dims // groups


def plan(head: nn.Module, weights: dict[str, mx.array],
         config: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """How each module of `head` (float, as `new_head` builds it) that `weights` (head layout)
    store quantized is quantized: {path: `to_quantized`'s arguments}. Raises ValueError with
    the reason where one cannot load."""
    out: dict[str, dict[str, Any]] = {}
    for path, module in head.named_modules():
        weight = weights.get(f"{path}.weight")
        if not path or not hasattr(module, "to_quantized") or weight is None:
            continue
        scales = weights.get(f"{path}.scales")
        if scales is None:
            if not mx.issubdtype(weight.dtype, mx.floating):
                raise ValueError(f"its MTP weights hold {path}.weight as {weight.dtype} "
                                 "without scales (not mlx's quantized layout)")
            continue
        if weight.dtype != mx.uint32:
            raise ValueError(f"its MTP weights hold {path}.weight as {weight.dtype} beside "
                             "scales (mlx packs quantized weights in uint32)")
        bits, group_size = _implied(path, weight, scales, module.weight.shape[-1])
        affine = scales.dtype != mx.uint8      # the other modes keep uint8 scales
        mode = "affine" if affine else _MODES.get((bits, group_size), "")
        declared = _declared(config, path) or {}
        said = str(declared.get("mode", "affine"))
        if (declared.get("bits"), declared.get("group_size")) == (bits, group_size) and \
                (said == "affine") == affine:
            mode = said
        if not mode:
            raise ValueError(f"its MTP weights hold {path} at {bits} bits in groups of "
                             f"{group_size} with uint8 scales: no quantization mode stores that")
        if mode == "affine" and f"{path}.biases" not in weights:
            raise ValueError(f"its MTP weights hold {path} quantized (affine, {bits} bits) "
                             "without its biases")
        args: dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": mode}
        if f"{path}.global_scale" in weights and \
                "global_scale" in inspect.signature(module.to_quantized).parameters:
            args["global_scale"] = True
        out[path] = args
    return out


def quantize(head: nn.Module, weights: dict[str, mx.array],
             config: dict[str, Any] | None) -> int:
    """Turn the modules of `head` that `weights` store quantized into their quantized kind
    (`plan`): how many. Raises ValueError where one cannot load (this mlx refusing its bits or
    group size, too)."""
    why = foreign(weights)
    if why:
        raise ValueError(why)
    modules = plan(head, weights, config)
    if not modules:
        return 0
    try:
        nn.quantize(head, class_predicate=lambda p, _: dict(modules[p]) if p in modules
                    else False)
    except (ValueError, RuntimeError) as e:
        shown = ", ".join(f"{p}: {a['bits']} bits, groups of {a['group_size']}, {a['mode']}"
                          for p, a in list(modules.items())[:2])
        raise ValueError(f"its MTP weights are quantized as this mlx cannot run ({shown}"
                         f"{', ...' if len(modules) > 2 else ''}): {e}") from e
    return len(modules)


def store_quantized(file: Path, bits: int = 4, group_size: int = 64) -> int:
    """Store the float head in `file` (checkpoint layout) quantized as a conversion stores
    one: each matrix whose rows split into groups of `group_size` packed (`mx.quantize`,
    affine) with its `scales` and `biases` beside it, the rest (norms) as it was; how many
    were quantized. The same weights, quantized: what the bench compares with the float head."""
    stored = mx.load(str(file))
    assert isinstance(stored, dict)
    out: dict[str, mx.array] = {}
    done = 0
    for name, v in stored.items():
        if not name.endswith(".weight") or v.ndim != 2 or v.shape[-1] % group_size:
            out[name] = v
            continue
        base = name.removesuffix(".weight")
        out[name], out[f"{base}.scales"], out[f"{base}.biases"] = \
            mx.quantize(v, group_size, bits)
        done += 1
    mx.save_safetensors(str(file), out)
    return done
