"""What a decode batch's pass leaves for one of its members' next step (`Fed`): pure, no mlx.

The pass returns it (`engine/batch/executor.py`, `Batch.step`) and its caller sends it into
that member's steps as they resume (`engine/pacing.py`, `Sent`); nothing is left on the run for
its steps to find.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Fed:
    """What a decode batch's pass that fed a request's pending token (with the other
    members', `engine/batch/executor.py`) left for its next step, sent into its steps as they
    resume: its row's logits and the token drawn from them in the same evaluation (None: it
    draws its own), or, where its row verified a draft, the tokens that pass emits for it
    (`ahead`: the accepted drafted ones and the first draw after them)."""

    logits: Any = None
    drawn: Any = None
    ahead: tuple[int, ...] = ()
