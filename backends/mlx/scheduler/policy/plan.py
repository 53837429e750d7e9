"""The next forward pass, planned (`Plan`), and which newcomers' prompts share a prefill pass
(pure, no mlx).

A pass is one of three: one job's `step` (a prefill slice, or a decode step alone); one
`decode` pass of every job decoding or whose prompt's last token waits (`Task.ready`: a
newcomer's first token comes from the decoding jobs' next pass, which nobody waits through a
pass of its own for), each row's draft sized by the batch executor (`engine/spec/company.py`);
or one `prefill` pass of several short prompts not started (at most `prefill_slice` tokens past
what the cache holds of each, at most `CONTEXT` tokens in all), all but their last token, each
row its restored prefix and the tokens after it, right-padded to the longest
(`engine/batch/prefill.py`), at most `MOST` of them, chosen so that padding costs at most `PAD`
both of the tokens they compute and of the positions they attend to: a follow-up turn (its
conversation restored) shares a pass with another follow-up of like length, not with a fresh
prompt whose pass would attend over padding the length of that conversation.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from prefixd.backends.mlx.scheduler.policy.slots import Slot

MOST = 8      # prompts in one prefill pass (stock mlx-lm's prefill batch)
PAD = 1.25    # a shared prefill pass's tokens, padding included, over its prompts' own
# a prompt longer than this prefills alone: a shared pass copies each row's restored prefix
# into the pass's cache and out again (memory twice, for a gain that shrinks as attention over
# the prefix outweighs the rows' shared weights)
CONTEXT = 2048


@dataclass(frozen=True)
class Plan:
    """The next pass: its kind and the admitted jobs it runs (the picked one first)."""

    kind: Literal["step", "decode", "prefill"]
    slots: list[Slot]


def short(s: Slot, slice_tokens: int) -> bool:
    """Whether `s` is a short prompt not started (or whose first pass was taken back,
    `Regrouped`): a row of a shared prefill pass (at least one token to prefill besides its
    last, at most `slice_tokens` past what its cache holds, at most `CONTEXT` in all)."""
    n = len(s.job.prompt.tokens)
    return (s.task is None or s.regrouped) and not s.job.cancelled and n <= CONTEXT and \
        2 <= s.remaining() <= slice_tokens


def regroups(slot: Slot, newcomers: list[Slot], slice_tokens: int) -> bool:
    """Whether `slot`'s first prefill pass, under way, is taken back to run again with
    `newcomers` (jobs that arrived during it, as they would be admitted): some of them would
    share its prompt's pass (`prefill_rows`, `slot` as if not started)."""
    before = Slot(slot.job, slot.kv_bytes,
                  cached=len(slot.job.prompt.tokens) - slot.remaining())
    return len(prefill_rows(before, [before, *newcomers], (), slice_tokens)) > 1


def _fits(lengths: list[int], n: int) -> bool:
    """Whether one more row of length `n` keeps padding these rows to the longest within
    `PAD` of their own lengths."""
    return max(*lengths, n) * (len(lengths) + 1) <= PAD * (sum(lengths) + n)


def prefill_rows(slot: Slot, active: Collection[Slot], excluded: Collection[Slot],
                 slice_tokens: int) -> list[Slot]:
    """`slot` and the short prompts that share its prefill pass: the nearest in length first
    (the tokens each computes, then its whole prompt), while padding every row to the longest
    stays within `PAD`, both of the tokens they compute and of the positions they attend to;
    just `slot` when it is not short or none fits."""
    if not short(slot, slice_tokens):
        return [slot]
    def shape(s: Slot) -> tuple[int, int]:
        return s.remaining(), len(s.job.prompt.tokens)
    width, size = shape(slot)
    others = sorted((s for s in active if s is not slot and s not in excluded
                     and short(s, slice_tokens)),
                    key=lambda s: (abs(shape(s)[0] - width), abs(shape(s)[1] - size)))
    rows, widths, sizes = [slot], [width], [size]
    for s in others:
        if len(rows) == MOST:
            break
        w, n = shape(s)
        if _fits(widths, w) and _fits(sizes, n):
            rows.append(s)
            widths.append(w)
            sizes.append(n)
    return rows
