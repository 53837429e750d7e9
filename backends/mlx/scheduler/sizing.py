"""What a job's live cache weighs, for admission by memory (`schedule.Schedule`): estimated
from a model's cache leaves after a pass, once per loaded model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def kv_bytes_per_token(leaves: Sequence[Any]) -> int:
    """Rough live-cache bytes per token of a model, from its cache leaves after a pass: the
    keys and values of its attention layers (recurrent states are fixed-size:
    `request_bytes`; a sliding window is counted as if unbounded: an overestimate)."""
    total = 0
    for c in leaves:
        for arrays in (getattr(c, "keys", None), getattr(c, "values", None)):
            for a in arrays if isinstance(arrays, tuple) else (arrays,):
                if a is not None and getattr(a, "ndim", 0) == 4 and a.shape[2]:
                    total += a.nbytes // a.shape[2]
    return total


def request_bytes(leaves: Sequence[Any], logits_bytes: int, width: int, goes_back: bool,
                  ahead: bool = False) -> int:
    """Rough bytes one request holds under way besides its KV, from a model's cache leaves
    after a one-token pass (`leaves`) and one position's logits: its fixed-size states
    (recurrent and convolution: `ArraysCache`), twice where a pass keeps the state before it
    to go back (`goes_back`: a verify pass's, `engine/inpass/captured.py`; `ahead`: a decode
    pass launched ahead of its step, `engine/batch/launch.py`), and its rows of a pass's
    logits and draws (`width` positions: a verify pass's; two with `ahead`: the step's and
    the launched pass's)."""
    width = max(width, 2) if ahead else width
    goes_back = goes_back or ahead
    states = sum(a.nbytes for c in leaves if isinstance(getattr(c, "cache", None), list)
                 for a in c.cache if a is not None)
    return states * (2 if goes_back else 1) + 2 * width * logits_bytes
