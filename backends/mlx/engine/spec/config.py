"""How the Engine speculates (`SpecConfig`), decided once at load (`spec_config`): the longest
draft, the leaves a verify pass captures to go back, the pass costs, the drafters beyond
prompt lookup (a draft model, the model's own MTP head), or why it does not (off, or a cache
that cannot go back exactly).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from mlx_lm.models.cache import ArraysCache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.spec.draft import DraftCosts, PassCosts, Standing
from prefixd.backends.mlx.engine.spec.mtpdraft import MTP

if TYPE_CHECKING:
    import mlx.core as mx

log = logging.getLogger("prefixd.worker.cache")


class SpecSettings(Protocol):
    """What `spec_config` reads of the worker's settings (`engine.config.EngineConfig`)."""

    @property
    def speculative(self) -> bool: ...

    @property
    def spec_draft_max(self) -> int | None: ...

    @property
    def spec_ngram(self) -> int: ...

    @property
    def spec_capture_bytes(self) -> int: ...


# The longest draft by default: where every layer trims (full attention) a longer draft costs
# only the pass (measured on the built-in model: a JSON copy 3.6x faster than without
# speculation at 8, 4.3x at 16; docs/BENCHMARKS.md); where recurrent or window state is
# captured at each position of a verify pass, each position's state is held until the next.
TRIMMED_DRAFT_MAX = 16
CAPTURED_DRAFT_MAX = 8


@dataclass(frozen=True)
class SpecConfig:
    """The Engine's speculative decoding: the longest draft, the shortest match drafted from, the
    leaves to capture in a verify pass (None: the model cannot go back, speculation is off)."""

    max_draft: int
    ngram: int
    leaves: tuple[int, ...]
    costs: PassCosts
    draft_model: Any = None     # drafts where the context has nothing to copy (`draftmodel.py`)
    draft_costs: DraftCosts | None = None
    capture_bytes: int = 64 * 2**20   # a verify pass's kept states at most (`replays`)
    mtp: MTP | None = None      # the model's own MTP head: drafts before a draft model would
    # where each request's model drafter pace starts: the last one's (`draft.Standing`)
    standing: Standing = field(default_factory=Standing)

    @property
    def watches(self) -> bool:
        """Whether its passes' hidden states feed a drafter (`Speculation.saw`)."""
        return self.mtp is not None

    def taken(self) -> mx.array | None:
        """The hidden states of the model's pass that just ran, where they feed a drafter
        (its MTP head's: `MTP.taken`), else None."""
        return self.mtp.taken() if self.mtp is not None else None

    def replays(self, cache: list[Any], width: int) -> bool:
        """Whether a verify pass `width` tokens wide over `cache` (every row) computes the
        captured recurrent states again where asked for instead of keeping one per position
        (`engine/inpass/captured.py`): where those kept would pass `capture_bytes`."""
        kept = sum(leaf.cache[-1].nbytes for i, leaf in enumerate(snapshot.leaves(cache))
                   if i in self.leaves and type(leaf) is ArraysCache and len(leaf.cache) > 1
                   and leaf.cache[-1] is not None)
        return kept * (width - 1) > self.capture_bytes



def spec_config(config: SpecSettings, snap_idx: tuple[int, ...], inpass: tuple[int, ...] | None,
                unsupported: str | None, timed: bool, draft_model: Any = None,
                probe: Callable[[], tuple[int, ...] | None] = lambda: None,
                mtp: MTP | None = None
                ) -> tuple[SpecConfig | None, str | None]:
    """The Engine's speculative decoding, or None and why not (logged): the live cache must
    go back exactly to any position of a verify pass (full attention trims; every other leaf
    is captured in the pass, which needs the in-pass tap verified for this model: `inpass`,
    else `probe`d here when checkpoints are not taken in passes; a group never probes: it
    would have to agree)."""
    if not config.speculative:
        return None, "off (speculative=false)"
    if snap_idx and inpass is None and not unsupported and timed:
        inpass = probe()
    why = None
    if unsupported:
        why = f"the cache cannot be snapshotted ({unsupported})"
    elif snap_idx and inpass is None:
        why = "recurrent or sliding-window state cannot be captured inside a pass here"
    if why:
        log.warning("speculative decoding is off for this model: %s", why)
        return None, why
    costs = PassCosts(timed=timed)
    longest = config.spec_draft_max or (CAPTURED_DRAFT_MAX if inpass else TRIMMED_DRAFT_MAX)
    drafts = draft_model is not None or mtp is not None
    if mtp is not None:
        mtp.watch()
    return SpecConfig(longest, config.spec_ngram, inpass or (), costs, draft_model,
                      DraftCosts(costs) if drafts else None, config.spec_capture_bytes,
                      mtp), None


def spec_info(spec: SpecConfig | None, unspeculative: str | None,
              refused: dict[str, dict[str, str]]) -> dict[str, Any]:
    """What GET /v1/cache says of how the Engine speculates (its passes' counts aside)."""
    return {"disabled_reason": unspeculative,
            "draft_max": spec.max_draft if spec else None,
            "draft_model": spec is not None and spec.draft_model is not None,
            "mtp": spec is not None and spec.mtp is not None,
            "refused": {k: dict(v) for k, v in refused.items()}}
