"""The next forward pass, planned (`Plan`), and which newcomers' prompts share a prefill pass
(pure, no mlx).

A pass is one of three: one job's `step` (a prefill slice, or a decode step alone); one
`decode` pass of every job decoding or whose prompt's last token waits (`Task.ready`: a
newcomer's first token comes from the decoding jobs' next pass, which nobody waits through a
pass of its own for), each row's draft sized by the batch executor (`engine/spec/company.py`);
or one `prefill` pass of several fresh short prompts (not started, nothing of them cached, at
most `prefill_slice` tokens), all but their last token, left-padded to the longest
(`engine/batch/prefill.py`), chosen so that padding costs at most `PAD` of their tokens, at most
`MOST` of them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from prefixd.backends.mlx.scheduler.policy.slots import Slot

MOST = 8      # prompts in one prefill pass (stock mlx-lm's prefill batch)
PAD = 1.25    # a shared prefill pass's tokens, padding included, over its prompts' own


@dataclass(frozen=True)
class Plan:
    """The next pass: its kind and the admitted jobs it runs (the picked one first)."""

    kind: Literal["step", "decode", "prefill"]
    slots: list[Slot]


def fresh(s: Slot, slice_tokens: int) -> bool:
    """Whether `s` is a short prompt not started whose cache holds none of it: a row of a
    shared prefill pass."""
    n = len(s.job.prompt.tokens)
    return s.task is None and s.cached == 0 and 2 <= n <= slice_tokens and not s.job.cancelled


def prefill_rows(slot: Slot, active: Collection[Slot], excluded: Collection[Slot],
                 slice_tokens: int) -> list[Slot]:
    """`slot` and the fresh prompts that share its prefill pass: the nearest in length first,
    while the pass (every row padded to the longest) stays within `PAD` of their tokens; just
    `slot` when it is not fresh or none fits."""
    if not fresh(slot, slice_tokens):
        return [slot]
    size = len(slot.job.prompt.tokens)
    others = sorted((s for s in active if s is not slot and s not in excluded
                     and fresh(s, slice_tokens)),
                    key=lambda s: abs(len(s.job.prompt.tokens) - size))
    rows, lengths = [slot], [size]
    for s in others:
        if len(rows) == MOST:
            break
        n = len(s.job.prompt.tokens)
        if max(*lengths, n) * (len(rows) + 1) <= PAD * (sum(lengths) + n):
            rows.append(s)
            lengths.append(n)
    return rows
