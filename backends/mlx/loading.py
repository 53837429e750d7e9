"""Loading a model into the worker: resolving and converting it (`provision.py`), its Engine
with the prompt cache's RAM budget and disk tier, and a warm-up pass. Runs on the generation
thread (`generation.py`), which owns what it returns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixd.backends.mlx.prompt import Renderer
from prefixd.backends.mlx.settings import WorkerSettings

log = logging.getLogger("prefixd.worker")


@dataclass
class Loaded:
    """A loaded model and what serves it."""

    model: Any
    tokenizer: Any
    renderer: Renderer
    engine: Any
    max_context: int | None


def max_context(model: Any) -> int | None:
    """The model's context length, from its config (None: unknown)."""
    args = getattr(model, "args", None)
    value = getattr(args, "max_position_embeddings", None)
    text_config = getattr(args, "text_config", None)
    if value is None and isinstance(text_config, dict):
        value = text_config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def load(settings: WorkerSettings, spec: str) -> Loaded:
    """Resolve and load `spec`, build its Engine (RAM and disk budgets), warm it up."""
    from prefixd.backends.mlx.engine import Engine, EngineConfig
    from prefixd.backends.mlx.provision import load_model, resolve_model

    target = resolve_model(spec, settings.cache_dir, progress=log.info)
    dequantize = wants_dequantize(settings.dequantize, spec)
    model, tokenizer = load_model(target, settings.cache_dir, progress=log.info,
                                  dequantize=dequantize)
    from prefixd.backends.mlx.disktier import model_fingerprint

    model_id = model_fingerprint(target, dequantize)
    engine = Engine(model, EngineConfig.from_settings(settings, cache_bytes=ram_budget(settings)),
                    disk_spec(settings, model_id), model_id)
    warm_up(model, engine.fresh_cache(), tokenizer)
    loaded = Loaded(model, tokenizer, Renderer(tokenizer), engine, max_context(model))
    log.info("worker: model %s loaded (%s, max context %s)", spec,
             type(model).__module__.rsplit(".", 1)[-1], loaded.max_context)
    return loaded


def ram_budget(settings: WorkerSettings) -> int:
    """The prompt cache's RAM budget: the setting, else measured once the model is loaded."""
    from prefixd.backends.mlx.memory import auto_ram_bytes, available_memory

    if settings.cache_bytes is not None:
        return settings.cache_bytes
    available = available_memory()
    budget = auto_ram_bytes(available)
    log.info("worker: prompt cache budget %.2f GiB in RAM (auto: %.1f GiB available after "
             "loading the model)", budget / 2**30, available / 2**30)
    return budget


def disk_spec(s: WorkerSettings, model_id: str) -> Any:
    """Where and how big the disk tier is for this model (None: off, or unusable)."""
    from prefixd.backends.mlx.disktier import DiskSpec
    from prefixd.backends.mlx.memory import auto_disk_bytes, free_space

    if s.disk_cache_bytes == 0:
        return None
    base = Path(s.cache_dir).expanduser() / "prompts"
    try:
        budget = s.disk_cache_bytes if s.disk_cache_bytes is not None else \
            auto_disk_bytes(free_space(base))
    except OSError as e:
        log.warning("worker: no disk tier: cannot use %s (%s)", base, e)
        return None
    return DiskSpec(base, model_id, budget,
                    s.disk_write_delay, s.disk_block_tokens)


def wants_dequantize(mode: str, spec: str) -> bool:
    """auto: float32 weights for the small built-in models when MLX runs on the CPU, where
    its quantized matmuls are several times slower than float ones."""
    if mode != "auto":
        return mode == "on"
    import mlx.core as mx

    from prefixd.backends.mlx.provision import BUILTIN_MODELS

    return spec in BUILTIN_MODELS and not mx.metal.is_available()


def warm_up(model: Any, cache: list[Any], tokenizer: Any) -> None:
    """A throwaway prefill, sampling (greedy and with temperature) and decode step at load, so
    the first request (often the first after a swap or a restart) does not pay first-call
    costs: mlx-lm's compiled samplers, kernels for new shapes, the detokenizer."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    try:
        logits = model(mx.array([[0] * 16]), cache=cache)[:, -1, :]
        lp = logits - mx.logsumexp(logits, keepdims=True)
        token = mx.array([0])
        for sampler in (make_sampler(0.0), make_sampler(0.7, 0.95, 0.05, top_k=20)):
            token = sampler(lp)
        mx.eval(model(token[None], cache=cache))
        tokenizer.decode([int(token)])
    except Exception:  # a warm-up that fails costs nothing but the warm-up
        log.warning("worker: warm-up pass failed", exc_info=True)
