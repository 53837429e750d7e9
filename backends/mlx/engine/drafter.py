"""A draft model's drafts for speculative decoding (`speculate.py`): a smaller model with the
served model's tokenizer writes the next tokens greedily, for the verify pass to check.

Owns: one request's draft-model cache (full attention only: it goes back by trimming) and the
tokens it holds. Before each draft it catches up with the request's tokens (the prompt on its
first draft, in passes of `CHUNK`; later the tokens accepted since), keeping what it holds of
them; its own guesses past them are trimmed. Loaded once per worker (`engine/loading.py`,
`spec_draft_model`); it never touches the served model's cache, so the output is the served
model's whatever it drafts.
"""

from __future__ import annotations

import time
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

CHUNK = 512
TAIL = 80   # where its tokens can differ from the request's: its own guesses (<= 64 drafted)


def draft_model_problem(model: Any, vocab: int, draft_vocab: int) -> str | None:
    """Why `model` cannot draft for a served model of `vocab` tokens, else None."""
    if vocab != draft_vocab:
        return f"its tokenizer has {draft_vocab} tokens, the served model's {vocab}"
    kinds = {type(c).__name__ for c in make_prompt_cache(model) if not c.is_trimmable()}
    if kinds:
        return f"its cache cannot go back by trimming ({', '.join(sorted(kinds))})"
    return None


class ModelDrafter:
    """One request's draft model state."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache = make_prompt_cache(model)
        self.tokens: list[int] = []
        self.passes, self.seconds = 0, 0.0   # of its last draft

    def propose(self, context: list[int], k: int) -> list[int]:
        """`k` tokens the draft model writes greedily after `context` (the request's tokens,
        the one about to be fed last)."""
        t0 = time.perf_counter()
        keep = self._common(context)
        if len(self.tokens) > keep:
            for c in self.cache:
                c.trim(len(self.tokens) - keep)
            del self.tokens[keep:]
        missing = context[keep:] or context[-1:]
        if not context[keep:]:       # it holds all of it: feed the last one again
            for c in self.cache:
                c.trim(1)
            del self.tokens[-1:]
        passes = 0
        for i in range(0, len(missing), CHUNK):
            logits = self.model(mx.array(missing[i:i + CHUNK])[None], cache=self.cache)
            passes += 1
        self.tokens.extend(missing)
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

    def _common(self, context: list[int]) -> int:
        """How many of its tokens are the request's: the request only appends, and what it
        holds past them is its own last draft (at most `TAIL` tokens), so only the tail is
        compared."""
        n = min(len(self.tokens), len(context))
        i = max(0, n - TAIL)
        while i < n and self.tokens[i] == context[i]:
            i += 1
        return i
