"""Tokenizing a chat prompt by its new part only: a conversation's next prompt repeats the last
one up to its newest messages, so its tokens are the earlier prompt's up to the last special
token both share (`<|im_start|>`, say) and the tokens of the rest.

Owns: the few most recent prompts' text and tokens (ids and character offsets), and whether
this tokenizer may be tokenized that way. Exact because a fast (HF `tokenizers`) tokenizer
splits its input at added tokens first and encodes each piece on its own, so the tokens after
an added token do not depend on the text before it. Checked, not assumed: the first
`CHECKS` suffix encodes and every `CHECK_EVERY`-th after are compared with a full encode, and
one difference turns suffix encoding off for good (logged). Called from the prompt threads
beside generation, so the recent prompts sit behind a lock.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("prefixd.worker")

RECENT = 8           # prompts kept (a few conversations at once)
CHECKS = 4           # suffix encodes compared with a full encode at first ...
CHECK_EVERY = 32     # ... and then every this many
MIN_CUT = 64         # characters: shorter shared parts are not worth the bookkeeping


@dataclass(frozen=True)
class _Encoded:
    text: str
    ids: list[int]
    starts: list[int]
    ends: list[int]
    cuts: list[int]   # indices of the added tokens (where a later prompt may be cut)


class SuffixEncoder:
    """`encode(text)` -> (ids, end offsets), equal to `backend.encode(text)`'s."""

    def __init__(self, backend: Any, added_ids: set[int]) -> None:
        self.backend = backend
        self.added = added_ids
        self.enabled = bool(added_ids)
        self.reused_tokens = 0   # tokens taken from earlier prompts (observability, tests)
        self._suffix_encodes = 0
        self._recent: deque[_Encoded] = deque(maxlen=RECENT)
        self._lock = threading.Lock()

    def encode(self, text: str) -> tuple[list[int], list[int] | None]:
        """The ids and end offsets of `text` (offsets None when the tokenizer's are not in
        order: callers then do without them)."""
        hit = self._find(text) if self.enabled else None
        if hit is None:
            return self._full(text)
        prev, k = hit
        cut = prev.starts[k]
        enc = self.backend.encode(text[cut:], add_special_tokens=False)
        offsets = [(s + cut, e + cut) for s, e in enc.offsets]
        ids = prev.ids[:k] + list(enc.ids)
        starts = prev.starts[:k] + [s for s, _ in offsets]
        ends = prev.ends[:k] + [e for _, e in offsets]
        with self._lock:
            self._suffix_encodes += 1
            check = (self._suffix_encodes <= CHECKS
                     or self._suffix_encodes % CHECK_EVERY == 0)
        if check:
            full = self._full(text, remember=False)
            if full[0] != ids or full[1] != ends:
                log.warning("worker: tokenizing only the new part of a prompt gave other "
                            "tokens than the whole prompt; tokenizing whole prompts from now on")
                self.enabled = False
                return full
        if ends != sorted(ends):
            return ids, None
        cuts = [i for i in prev.cuts if i < k] + self._cuts(enc.ids, k)
        self._remember(_Encoded(text, ids, starts, ends, cuts))
        with self._lock:
            self.reused_tokens += k
        return ids, ends

    def _full(self, text: str, remember: bool = True) -> tuple[list[int], list[int] | None]:
        enc = self.backend.encode(text, add_special_tokens=False)
        ids = list(enc.ids)
        starts = [s for s, _ in enc.offsets]
        ends = [e for _, e in enc.offsets]
        if ends != sorted(ends):
            return ids, None
        if remember and self.enabled:
            self._remember(_Encoded(text, ids, starts, ends, self._cuts(ids)))
        return ids, ends

    def _cuts(self, ids: Any, first: int = 0) -> list[int]:
        """Indices (from `first`) of the added tokens among `ids`."""
        return [first + i for i, t in enumerate(ids) if t in self.added]

    def _remember(self, enc: _Encoded) -> None:
        with self._lock:
            self._recent.appendleft(enc)

    def _find(self, text: str) -> tuple[_Encoded, int] | None:
        """The earlier prompt and the index of its added token that start the longest part
        `text` shares with it (at least `MIN_CUT` characters)."""
        with self._lock:
            recent = list(self._recent)
        best: tuple[_Encoded, int] | None = None
        best_cut = MIN_CUT - 1
        for prev in recent:
            for k in reversed(prev.cuts):
                cut = prev.starts[k]
                if cut <= best_cut:
                    break
                if text.startswith(prev.text[:cut]) and text.startswith(
                        prev.text[cut:prev.ends[k]], cut):
                    best, best_cut = (prev, k), cut
                    break
        return best


def added_token_ids(tokenizer: Any) -> set[int]:
    """The ids of the tokenizer's added tokens (split out before the model encodes the rest)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(decoder, dict):
        return {int(i) for i in decoder}
    return set()
