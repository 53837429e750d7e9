"""Loading a model into the worker: resolving and converting it (`model/provision.py`), its
Engine with the prompt cache's RAM budget and disk tier, and a warm-up pass. Runs on the
generation thread (`scheduler/generator.py`), which owns what it returns. In a group worker
every rank loads its shard (`distribute`: pipeline or tensor parallel, as mlx-lm provides them,
over the lockstep's MLX group) and the same Engine, with the group's smallest RAM budget and a
disk tier of its own shard's states.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixd.backends.mlx.chat.prompt import Renderer
from prefixd.backends.mlx.group.lockstep import Lockstep
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
    parallel: str | None = None   # a group worker's split: pipeline or tensor


def max_context(model: Any) -> int | None:
    """The model's context length, from its config (None: unknown)."""
    from prefixd.backends.mlx.model.provision import window_of

    return window_of(getattr(model, "args", None))


def load(settings: WorkerSettings, spec: str, lockstep: Lockstep | None = None) -> Loaded:
    """Resolve and load `spec` (this rank's shard of it, in a group), build its Engine (RAM
    and disk budgets), warm it up."""
    from prefixd.backends.mlx.engine.engine import Engine, EngineConfig
    from prefixd.backends.mlx.model.provision import load_model, resolve_model

    target = resolve_model(spec, settings.cache_dir, progress=log.info)
    dequantize = wants_dequantize(settings.dequantize, spec)
    lockstep = lockstep or Lockstep()
    group, mode = lockstep.group, None
    model, tokenizer = load_model(target, settings.cache_dir, progress=log.info,
                                  dequantize=dequantize and group is None,
                                  **({"lazy": True} if group is not None else {}))
    if group is not None:
        mode = distribute(model, group, settings.parallel)
        if dequantize:
            from prefixd.backends.mlx.model.provision import dequantize_model

            dequantize_model(model)
        log.info("worker: rank %d of %d holds its %s-parallel shard", lockstep.rank, lockstep.size,
                 mode)
    from prefixd.backends.mlx.engine.tierglue import model_fingerprint

    model_id = model_fingerprint(target, dequantize)
    lockstep.mode = mode or ""
    model_id += lockstep.shard   # a group's ranks: each disk tier holds its own shard's states
    disk = disk_spec(settings, model_id)
    draft, draft_why = load_draft(settings, tokenizer, group is None)
    mtp, mtp_why = load_mtp(settings, model, target, lockstep)
    engine = Engine(model, EngineConfig.from_settings(
        settings, cache_bytes=lockstep.min(ram_budget(settings))), disk, model_id, lockstep,
        draft, mtp, refusals(settings, target, draft_why, mtp_why))
    warm_up(model, engine.fresh_cache(), tokenizer)
    loaded = Loaded(model, tokenizer, Renderer(tokenizer), engine, max_context(model), mode)
    log.info("worker: model %s loaded (%s, max context %s)", spec,
             type(model).__module__.rsplit(".", 1)[-1], loaded.max_context)
    return loaded


def load_draft(settings: WorkerSettings, tokenizer: Any, alone: bool
               ) -> tuple[Any, str | None]:
    """The draft model of speculative decoding (`spec_draft_model`), or None and why one
    asked for is not used: in a group (its ranks would each need it), one that does not load,
    or one that cannot draft (`drafter.draft_model_problem`: its tokenizer, its weights, its
    cache). None, None: none asked for."""
    if not settings.spec_draft_model or not settings.speculative:
        return None, None
    if not alone:
        return None, "a group worker does not draft with one"
    from prefixd.backends.mlx.engine.spec.draftmodel import draft_model_problem
    from prefixd.backends.mlx.model.provision import load_model, resolve_model

    spec = settings.spec_draft_model
    try:
        target = resolve_model(spec, settings.cache_dir, progress=log.info)
        draft, draft_tokenizer = load_model(
            target, settings.cache_dir, progress=log.info,
            dequantize=wants_dequantize(settings.dequantize, spec))
    except Exception as e:    # a damaged draft model costs its drafts, not the model
        return None, f"it does not load ({type(e).__name__}: {e})"
    why = draft_model_problem(draft, tokenizer, draft_tokenizer)
    if why:
        return None, why
    log.info("worker: draft model %s loaded for speculative decoding", spec)
    return draft, None


def load_mtp(settings: WorkerSettings, model: Any, folder: str,
             lockstep: Lockstep | None = None) -> tuple[Any, str | None]:
    """The model's own multi-token-prediction head (`spec_mtp`), or None and why the one its
    checkpoint carries is not used: one that does not fit the model or is not all finite
    (`model/mtp.py`), or, in a group, where not every rank can draft alike. A group's ranks
    each load the head and draft alike where the model is split pipeline-parallel: every rank
    then holds the model's final hidden states (mlx-lm gathers the last rank's to all), its
    embedding and whole output projection, so its drafts, like its sampled tokens, are a
    function of the journaled tokens; tensor-parallel ranks each hold a slice of the output
    projection (refused). Every rank must have loaded it (agreed), else none drafts with it.
    None, None: off, or none in its checkpoint."""
    if not settings.spec_mtp or not settings.speculative:
        return None, None
    from prefixd.backends.mlx.engine.spec.mtpdraft import MTP
    from prefixd.backends.mlx.model.mtp import load_head, parts

    lockstep = lockstep or Lockstep()
    head, why = load_head(model, folder)
    found = parts(model)
    if lockstep.size > 1:
        if head is not None and lockstep.mode != "pipeline":
            head, why = None, (f"a {lockstep.mode}-parallel group splits the output projection "
                               "across its ranks (a pipeline-parallel one drafts with it)")
        if not lockstep.all(head is not None) and head is not None:   # every rank asks
            head, why = None, "another rank of the group has no MTP head it can use"
    if head is None or found is None:
        return None, why
    log.info("worker: the model's MTP head drafts for speculative decoding")
    return MTP(head, found), None


def refusals(settings: WorkerSettings, folder: str, draft_why: str | None,
             mtp_why: str | None) -> dict[str, dict[str, str]]:
    """The drafters asked for but not used, each named with why (`/v1/cache`
    `speculative.refused`), each logged as a warning."""
    out = {}
    for kind, name, why in (("draft_model", settings.spec_draft_model or "", draft_why),
                            ("mtp", folder, mtp_why)):
        if why:
            why = " ".join(why.split())   # one line (mlx's load errors span several)
            out[kind] = {"name": name, "reason": why}
            if kind == "draft_model":
                log.warning("worker: draft model %s is not used: %s", name, why)
            else:
                log.warning("worker: the model's MTP head is not used: %s (in %s)", why, name)
    return out


def distribute(model: Any, group: Any, parallel: str) -> str:
    """Keep this rank's shard of `model` (loaded lazily) and load its weights: "pipeline"
    (consecutive layers per rank; mlx-lm's `pipeline`), "tensor" (every layer's heads split;
    its `shard`), or "auto" (pipeline where the architecture has it, else tensor)."""
    import mlx.core as mx

    inner: Any = getattr(model, "model", None)
    can = {"pipeline": hasattr(inner, "pipeline"), "tensor": hasattr(model, "shard")}
    mode = parallel if parallel != "auto" else ("pipeline" if can["pipeline"] else "tensor")
    if not can.get(mode):
        offered = [m for m, ok in can.items() if ok] or ["none"]
        raise ValueError(f"{type(model).__module__} cannot run {mode}-parallel in this mlx-lm "
                         f"(it offers: {', '.join(offered)})")
    if mode == "pipeline":
        inner.pipeline(group)
    else:
        model.shard(group)
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # all loaded
    return mode


def ram_budget(settings: WorkerSettings) -> int:
    """The prompt cache's RAM budget: the setting, else measured once the model is loaded."""
    from prefixd.backends.mlx.model.memory import auto_ram_bytes, available_memory

    if settings.cache_bytes is not None:
        return settings.cache_bytes
    available = available_memory()
    budget = auto_ram_bytes(available)
    log.info("worker: prompt cache budget %.2f GiB in RAM (auto: %.1f GiB available after "
             "loading the model)", budget / 2**30, available / 2**30)
    return budget


def disk_spec(s: WorkerSettings, model_id: str) -> Any:
    """Where and how big the disk tier is for this model (None: off, or unusable)."""
    from prefixd.backends.mlx.engine.tierglue import DiskSpec
    from prefixd.backends.mlx.model.memory import auto_disk_bytes, free_space

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

    from prefixd.backends.mlx.model.provision import BUILTIN_MODELS

    return spec in BUILTIN_MODELS and not mx.metal.is_available()


def warm_up(model: Any, cache: list[Any], tokenizer: Any) -> None:
    """A throwaway prefill, sampling (greedy and with temperature) and decode step at load, so
    the first request (often the first after a swap or a restart) does not pay first-call
    costs: mlx-lm's compiled samplers, kernels for new shapes, the detokenizer."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    try:
        logits = model(mx.array([[0] * 16]), cache=cache)[:, -1, :]
        mx.eval(logits)   # one forward pass per graph (a group's ranks meet in each)
        lp = logits - mx.logsumexp(logits, keepdims=True)
        token = mx.array([0])
        for sampler in (make_sampler(0.0), make_sampler(0.7, 0.95, 0.05, top_k=20)):
            token = sampler(lp)
        mx.eval(model(token[None], cache=cache))
        tokenizer.decode([int(token)])
    except Exception:  # a warm-up that fails costs nothing but the warm-up
        log.warning("worker: warm-up pass failed", exc_info=True)
