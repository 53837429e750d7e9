"""What a drafter must be to draft for a served model, checked once when it loads (a draft
model: `engine/loading.py`; the model's own MTP head: `mtp.py`).

Drafting is exact whatever a drafter proposes (the verify pass decides), so a damaged drafter
never changes a reply: it costs time, every draft rejected. These checks refuse it at load
instead, with a reason the worker logs and reports:

- weights: every floating array finite (no NaN, no infinity), as it will run (after any cast
  to the model's dtype, which can overflow a large value to infinity); quantized arrays are
  integers and cannot be;
- tokenizer (a draft model's): the served model's, token by token. A draft proposes token ids
  that the verify pass compares with the served model's, so each id must name the same token:
  the same token-to-id map (added tokens too), not only as many tokens, and the same
  end-of-sequence ids. How text is split into tokens does not matter here (a draft only ever
  sees the served model's ids), nor its chat template.

Owns nothing; reads what it is given.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten


def nonfinite(module: Any) -> str | None:
    """Which of `module`'s weights are not finite, as "fc.weight holds NaN (and 14 more of its
    15 arrays)" (None: every floating array is finite): one reduction per array, evaluated
    together (one sync)."""
    weights = cast(list[tuple[str, mx.array]], tree_flatten(module.parameters()))
    flat = [(k, v) for k, v in weights if mx.issubdtype(v.dtype, mx.floating)]
    if not flat:
        return None
    finite = mx.stack([mx.all(mx.isfinite(v)) for _, v in flat])
    mx.eval(finite)
    bad = [k for (k, _), ok in zip(flat, cast(list[bool], finite.tolist()), strict=True)
           if not ok]
    if not bad:
        return None
    first = dict(flat)[bad[0]]
    kind = "NaN" if mx.any(mx.isnan(first)).item() else "infinities"
    more = f" (and {len(bad) - 1} more of its {len(flat)} arrays)" if len(bad) > 1 else ""
    return f"{bad[0]} holds {kind}{more}"


def tokenizer_difference(served: Any, draft: Any) -> str | None:
    """How `draft`'s tokenizer differs from the `served` model's where drafting needs them
    the same (None: it does not); both mlx-lm tokenizers (or anything with `get_vocab` and
    `eos_token_ids`)."""
    mine, theirs = _vocab(served), _vocab(draft)
    if len(mine) != len(theirs):
        return f"its tokenizer has {len(theirs)} tokens, the served model's {len(mine)}"
    if mine != theirs:
        names, their_names = _names(mine), _names(theirs)
        differ = sorted(i for i in names.keys() | their_names.keys()
                        if names.get(i) != their_names.get(i))
        first = differ[0]
        return (f"its tokenizer maps {len(differ)} token ids to other tokens (id {first}: "
                f"{their_names.get(first)!r}, the served model's {names.get(first)!r})")
    eos, their_eos = _eos(served), _eos(draft)
    if eos != their_eos:
        return (f"its end-of-sequence token ids are {sorted(their_eos)}, the served model's "
                f"{sorted(eos)}")
    return None


def _vocab(tokenizer: Any) -> dict[str, int]:
    return dict(tokenizer.get_vocab())


def _names(vocab: dict[str, int]) -> dict[int, str]:
    return {i: t for t, i in vocab.items()}


def _eos(tokenizer: Any) -> set[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        one = getattr(tokenizer, "eos_token_id", None)
        ids = [] if one is None else [one]
    return {int(i) for i in ids}
