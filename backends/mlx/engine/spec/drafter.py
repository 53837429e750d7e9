"""What a drafter is (`Drafter`), and the context it drafts after (`Context`).

Three drafters implement it: prompt lookup over the request's own tokens (`lookup.py`), a
smaller draft model (`draftmodel.py`) and the served model's multi-token-prediction head
(`mtpdraft.py`). `speculate.Speculation` asks them in that order, each paced on its own
(`draft.Pace`), and verifies what one proposed; none of them sees the cache being verified.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, overload

import mlx.core as mx


class Context(Sequence[int]):
    """A request's tokens, the one about to be fed last: `prompt + fed + [token]`, read without
    building the list (a drafter reads only the part it has not seen)."""

    def __init__(self, prompt: list[int], fed: list[int], token: int) -> None:
        self.prompt, self.fed, self.token = prompt, fed, token

    def __len__(self) -> int:
        return len(self.prompt) + len(self.fed) + 1

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step == 1 and start >= len(self.prompt):   # the reply's part: no prompt copy
                return [*self.fed, self.token][start - len(self.prompt):stop - len(self.prompt)]
            return [*self.prompt, *self.fed, self.token][i]
        n = len(self)
        i = i + n if i < 0 else i
        if not 0 <= i < n:
            raise IndexError(i)
        if i < len(self.prompt):
            return self.prompt[i]
        i -= len(self.prompt)
        return self.fed[i] if i < len(self.fed) else self.token


class Drafter(Protocol):
    """Proposes the tokens after a context, for a verify pass to check."""

    kind: str            # who it is in the counts: "lookup", "model" or "mtp"
    passes: int          # forward passes its last draft took (0: none, a lookup)
    seconds: float       # and their time

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """At most `k` tokens after `context` (empty: nothing worth verifying)."""
        ...

    def saw(self, start: int, hidden: mx.array | None, row: int = 0, n: int = -1) -> None:
        """The served model's hidden states at positions start..start + n (row `row` of the
        pass that just ran): only a drafter that reads them keeps them."""
        ...

    def reset(self) -> None:
        """Hold nothing (the request ended, or it starts again)."""
        ...

