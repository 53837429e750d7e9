"""An upstream's `usage` object, parsed once (at the relay) into a frozen value everyone reads.

One rule for odd values: a count is an `int` that is not a `bool`, from 0 up to 2**40; anything
else (a string, a float, `true`, a negative or absurd number, a missing key) is "not reported"
(None). Upstream data is never trusted, so no reader re-checks a count or parses `usage` again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefixd.api.values import count, obj, seconds


@dataclass(frozen=True, slots=True)
class Usage:
    """What a backend reported of one answer: `prompt`, `cached` (of the prompt, from
    `prompt_tokens_details.cached_tokens`) and `completion` tokens, each None when not
    reported as a count; `worker`, a prefixd worker's per-turn breakdown (the `prefixd` object
    of its answer: cache hit, miss reason, timings, restorable digest), else None."""

    prompt: int | None = None
    completion: int | None = None
    cached: int | None = None
    worker: Mapping[str, Any] | None = None

    @classmethod
    def parse(cls, usage: object, worker: object = None) -> Usage | None:
        """The `usage` object of an OpenAI answer (None when it has none) with the answer's
        `prefixd` breakdown, if any."""
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(count(usage.get("prompt_tokens")), count(usage.get("completion_tokens")),
                   count(cached), worker if isinstance(worker, dict) else None)

    def behind_s(self) -> float | None:
        """A prefixd worker's time behind other requests (its `queue`, waiting to start, and
        `paused`, started but paused while theirs ran), seconds; None when not reported."""
        timings = obj((self.worker or {}).get("timings_ms"))
        parts = [seconds(timings.get(k)) for k in ("queue", "paused")]
        known = [p for p in parts if p is not None]
        return sum(known) / 1000 if known else None

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI shape again (counts that were reported), for logs and tests."""
        out: dict[str, Any] = {}
        if self.prompt is not None:
            out["prompt_tokens"] = self.prompt
        if self.completion is not None:
            out["completion_tokens"] = self.completion
        if self.cached is not None:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return out
