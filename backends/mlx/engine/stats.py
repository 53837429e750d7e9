"""Where one request's time went in the worker: the per-turn breakdown.

Owns: `PromptStats` (filled by the Engine while it restores, prefills, checkpoints, samples the
first token and commits), the `prefixd` JSON object the worker adds to its responses (the final
non-streamed response and the usage chunk of a stream; with `restorable`, what the worker can
restore of the request's tokens, from `engine/restorable.py`), the stage histograms, and the DEBUG
log line. Stages, in request order:

- `template`, `tokenize`, `boundaries`: building the prompt (beside generation, on a thread);
- `queue`: waiting for the generation thread (another request was running), `paused`: with
  max_active > 1, admitted but paused while other requests' forward passes ran (between its
  own, until its end): `queue` + `paused` is its time behind others;
- `lookup`, `restore`: finding the cached prefix and rebuilding the live cache from it;
- `prefill`: the forward passes over the prompt tokens not cached (`prefill_segments`: tokens
  and milliseconds of each pass, its own compute only; `prefill_yields`: how many times a pass
  paused between two layers so a newly arrived request could run first), `checkpoint`: taking
  checkpoints between them;
- `first_token`: sampling the first token (the last forward pass's logits are computed here);
- `commit`: storing the cache after the reply (not part of the time to first token).

With speculative decoding, `speculative` counts the request's verify passes and the tokens
they drafted and accepted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from prefixd.metrics import worker as metrics

log = logging.getLogger("prefixd.worker.cache")

STAGES = ("template", "tokenize", "boundaries", "queue", "paused", "lookup", "restore", "prefill",
          "checkpoint", "first_token", "commit")


@dataclass
class PromptStats:
    """One request's prompt: how much was cached, and the time of each stage (seconds)."""

    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens restored from the cache (not recomputed)
    recomputed_tokens: int = 0  # prompt tokens actually run through the model
    fallback: str | None = None  # why the cache was bypassed, else None
    lookup_s: float = 0.0
    restore_s: float = 0.0
    prefill_s: float = 0.0  # the whole prefill loop, checkpoints included
    segments: list[tuple[int, float]] = field(default_factory=list)  # (tokens, s) per pass
    yields: int = 0  # times a prefill pass paused between two layers for another job's passes
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    checkpoint_s: float = 0.0
    first_token_s: float = 0.0
    commit_s: float = 0.0
    tier: str | None = None  # where the cached prefix came from: ram, disk (None: nowhere)
    known_tokens: int = 0  # the longest restorable prefix the worker knew of for this prompt
    miss: str | None = None  # why fewer than known_tokens were restored (tiers.MISS_REASONS)
    disk_load_s: float = 0.0  # reading and rebuilding a disk record (part of restore)
    # speculative decoding (`engine/spec/speculate.py`): None when the request did not speculate
    speculative: dict[str, int] | None = None

    def seconds(self) -> dict[str, float]:
        """The engine's stages (forward passes and checkpoints counted apart)."""
        return {"lookup": self.lookup_s, "restore": self.restore_s,
                "prefill": max(0.0, self.prefill_s - self.checkpoint_s),
                "checkpoint": self.checkpoint_s, "first_token": self.first_token_s,
                "commit": self.commit_s}


def breakdown(stats: PromptStats | None, before: dict[str, float],
              restorable: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `prefixd` object of a response: `before` holds the stages outside the Engine
    (template, tokenize, boundaries, queue), in seconds; `restorable`, the prefixes of the
    request's tokens the worker can restore now (`engine/restorable.py`)."""
    seconds = {**before, **(stats.seconds() if stats else {})}
    out: dict[str, Any] = {
        "timings_ms": {k: round(seconds[k] * 1000, 3) for k in STAGES if k in seconds},
        "cached_tokens": stats.cached_tokens if stats else 0,
        "recomputed_tokens": stats.recomputed_tokens if stats else 0,
    }
    if stats is not None:
        out["prefill_segments"] = [{"tokens": n, "ms": round(s * 1000, 3)}
                                   for n, s in stats.segments]
        out["prefill_yields"] = stats.yields
        out["checkpoints"] = {"count": stats.checkpoints, "bytes": stats.checkpoint_bytes}
        if stats.fallback:
            out["fallback"] = stats.fallback
        out["cache"] = {"tier": stats.tier, "known_tokens": stats.known_tokens,
                        "miss": stats.miss}
        if stats.tier == "disk":
            out["cache"]["disk_load_ms"] = round(stats.disk_load_s * 1000, 3)
        if stats.speculative is not None:
            out["speculative"] = stats.speculative
    if restorable is not None:
        out["restorable"] = restorable
    return out


def observe(stats: PromptStats | None, before: dict[str, float]) -> None:
    """Record one finished request in the stage histograms and the DEBUG log."""
    seconds = {**before, **(stats.seconds() if stats else {})}
    for stage, s in seconds.items():
        metrics.STAGE_SECONDS.labels(stage).observe(s)
    if stats is not None:
        metrics.PREFILL_PASSES.observe(len(stats.segments))
        metrics.CHECKPOINTS_TAKEN.inc(stats.checkpoints)
        metrics.CHECKPOINT_TAKEN_BYTES.inc(stats.checkpoint_bytes)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("turn breakdown: %s", breakdown(stats, before))
