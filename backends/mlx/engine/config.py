"""What the Engine reads of the worker's settings: `EngineConfig`, pure."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixd.backends.mlx.settings import WorkerSettings


@dataclass(frozen=True)
class EngineConfig:
    """What the Engine reads of the worker's settings (same names, same meaning)."""

    cache_bytes: int = 4 * 1024**3
    checkpoint_interval: int | None = None  # None: sized automatically at start-up
    checkpoint_interval_policy: str = "bytes"   # "cost": also bounded by the pass cost
    checkpoint_inpass: bool = True              # capture inside passes where verified
    checkpoint_tail: int = 4
    prefill_chunk: int = 512
    kv_bits: int | None = None
    speculative: bool = True                    # draft by prompt lookup, verify exactly
    decode_ahead: str = "auto"                  # launch a batch's next pass early (`launch.py`)
    spec_draft_max: int | None = None          # None: by cache kind (`spec_config`)
    spec_ngram: int = 2
    spec_capture_bytes: int = 64 * 2**20

    @classmethod
    def from_settings(cls, settings: WorkerSettings, **override: Any) -> EngineConfig:
        values = {f.name: getattr(settings, f.name) for f in fields(cls)}
        return cls(**{**values, **override})
