"""A draft model's drafts for speculative decoding (a `drafter.Drafter`): a smaller model with the
served model's tokenizer writes the next tokens greedily, for the verify pass to check. One
whose tokenizer is not the served model's token for token, whose weights are not all finite,
or whose cache cannot go back is refused at load (`draft_model_problem`).

Owns: one request's draft-model cache and the tokens it holds. Before each draft it catches up
with the request's tokens (the prompt on its first draft, in passes of `CHUNK`; later the
tokens accepted since), keeping what it holds of them; its own guesses past them go. A draft
model whose layers all trim (full attention) trims them; one with recurrent or sliding-window
layers (a small Qwen3.5 drafting for a large one: hybrids all through) goes back to where its
last draft began, from the state it kept there (one snapshot of those layers), and feeds the
accepted tokens again with the new one, in one pass. Loaded once per worker
(`engine/loading.py`, `spec_draft_model`); it never touches the served model's cache, so the
output is the served model's whatever it drafts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.model.checks import nonfinite, tokenizer_difference

CHUNK = 512
TAIL = 80   # where its tokens can differ from the request's: its own guesses (<= 64 drafted)


def draft_model_problem(model: Any, tokenizer: Any, draft_tokenizer: Any) -> str | None:
    """Why `model` (with `draft_tokenizer`) cannot draft for a served model of `tokenizer`,
    else None: a tokenizer whose ids name other tokens, weights not all finite
    (`model/checks.py`), a cache that cannot go back."""
    why = tokenizer_difference(tokenizer, draft_tokenizer)
    if why:
        return why
    bad = nonfinite(model)
    if bad:
        return f"its weights are not all finite: {bad}"
    why = snapshot.unsupported(make_prompt_cache(model))
    return f"its cache cannot go back ({why})" if why else None


class ModelDrafter:
    """One request's draft model state."""

    kind = "model"

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache = make_prompt_cache(model)
        self.tokens: list[int] = []
        # leaves that go back from a snapshot, not a trim, and the snapshot: (position, leaves)
        self.leaves = snapshot.snapshot_indices(self.cache)
        self.mark: tuple[int, snapshot.Snapshot] | None = None
        self.passes, self.seconds = 0, 0.0   # of its last draft

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """`k` tokens the draft model writes greedily after `context` (the request's tokens,
        the one about to be fed last)."""
        t0 = time.perf_counter()
        self._back(context)
        missing = list(context[len(self.tokens):])
        passes = 0
        for i in range(0, len(missing), CHUNK):
            logits = self.model(mx.array(missing[i:i + CHUNK])[None], cache=self.cache)
            passes += 1
        self.tokens.extend(missing)
        if self.leaves:   # where this draft begins: what the next one goes back to
            snapshot.evaluate(self.cache)
            self.mark = (len(self.tokens), snapshot.take(self.cache, self.leaves)[0])
        out: list[int] = []
        while True:
            token = mx.argmax(logits[:, -1, :], axis=-1)
            mx.eval(token)
            out.append(cast(list[int], token.tolist())[0])
            if len(out) == k:
                break
            logits = self.model(token[None], cache=self.cache)
            self.tokens.append(out[-1])
            passes += 1
        self.passes, self.seconds = passes, time.perf_counter() - t0
        return out

    def _back(self, context: Sequence[int]) -> None:
        """Keep of its cache what the request's `context` shares, leaving at least one token
        of it to feed (its logits draft): trimmed where every layer trims, else back to its
        mark (or, if the context left it, to nothing)."""
        keep = min(self._common(context), len(context) - 1)
        if keep >= len(self.tokens):
            return
        if not self.leaves:
            for c in self.cache:
                c.trim(len(self.tokens) - keep)
            del self.tokens[keep:]
            return
        at, snap = self.mark or (0, {})
        if not snap or keep < at:
            self.reset()
            return
        self.cache = snapshot.rewound(self.cache, snap, len(self.tokens) - at)
        del self.tokens[at:]

    def saw(self, start: int, hidden: mx.array | None, row: int = 0, n: int = -1) -> None:
        """It reads tokens only (its own model's states are its cache's)."""

    def reset(self) -> None:
        """Hold nothing (let go of its cache: `Speculation.release`, or starting again)."""
        self.cache, self.tokens, self.mark = make_prompt_cache(self.model), [], None

    def _common(self, context: Sequence[int]) -> int:
        """How many of its tokens are the request's: the request only appends, and what it
        holds past them is its own last draft (at most `TAIL` tokens), so only the tail is
        compared."""
        n = min(len(self.tokens), len(context))
        i = max(0, n - TAIL)
        while i < n and self.tokens[i] == context[i]:
            i += 1
        return i
