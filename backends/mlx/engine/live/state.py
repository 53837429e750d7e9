"""The live state of one generation, as the decode batch and speculation see it (`Live`).

Owns: the live cache of the running request (empty while a decode batch holds its row), how
far it got (`pos` prompt tokens and the `fed` generated tokens are in it), the token it feeds
next (`pending`: the one it sampled last, or, while its prefill waits for a decode pass to
carry it, its prompt's last token: `prompt_pending`), whether an exception left the state
unknown (`broken`), its sampler and processors, its drafting (`spec`), and the tokens a verify
pass accepted that its steps have not yielded yet (`ahead`). What a batch's pass leaves for its
next step is not kept here: the pass returns it and its caller sends it into the run's steps
(`live.fed.Fed`). The prefill's own state and the steps of a generation are `engine/run.py`'s
(`Run` extends this class).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from prefixd.backends.mlx.cache import snapshot
from prefixd.backends.mlx.engine.spec.speculate import Speculation


class Seat(Protocol):
    """The decode batch a run's row is in, as the run sees it (`batch.executor.Batch`)."""

    cache: list[Any] | None

    def leave(self, run: Any) -> None:
        """Its row out of the batch: its own cache back."""
        ...

    def leaves_of(self, run: Any, kept: tuple[int, ...]) -> snapshot.Snapshot:
        """Its row of the batch's leaves `kept` (any kind), as a checkpoint holds them."""
        ...

    def row(self, run: Any) -> list[Any]:
        """A copy of its row's cache (it stays in the batch)."""
        ...

    def states_of(self, run: Any, kept: tuple[int, ...]) -> snapshot.Snapshot:
        """Its row of the batch's leaves `kept`, in arrays of its own."""
        ...


class Live:
    """One generation's live state (see the module docstring)."""

    def __init__(self, model: Any, cache: list[Any], prompt: list[int], start: int,
                 should_stop: Callable[[], bool]) -> None:
        self.model, self.cache, self.prompt = model, cache, prompt
        self.start, self.should_stop = start, should_stop
        self.pos = start  # prompt tokens in the KV state
        self.fed: list[int] = []  # generated tokens in the KV state
        self.pending: int | None = None  # the next token to feed (not yet in the cache)
        # `pending` is the prompt's last token: its prefill ends in a decode pass's row
        self.prompt_pending = False
        self.broken = False  # an exception hit mid-forward: the cache state is unknown
        # decoding in a batch (`engine/batch/executor.py`): the batch holds the cache (`cache`
        # is empty) and feeds `pending` with the other members'
        self.batch: Seat | None = None
        self.sampled, self.max_tokens = 0, 0   # decode steps sampled, of at most max_tokens
        self.batched = 0   # the requests of each decode pass that fed it, summed
        self.sampler: Callable[[mx.array], mx.array] = lambda x: x
        self.processors: list = []
        self.spec: Speculation | None = None   # drafting, when this request speculates
        self.ahead: list[int] = []   # tokens a verify pass accepted, not yet yielded
        # (reply tokens, the recurrent states there): where a possible stop string began
        self.stop_mark: tuple[int, snapshot.Snapshot] | None = None
        self.hidden: mx.array | None = None   # its last pass's hidden states, for an MTP head
        self.feed_last = True   # at its end, its last token is fed (`Run.feed_pending`)

    def fed_pending(self) -> None:
        """A pass fed `pending`: it is in the cache now (a prompt token or a reply token)."""
        assert self.pending is not None
        if self.prompt_pending:
            self.pos += 1
            self.prompt_pending = False
        else:
            self.fed.append(self.pending)
        self.pending = None

    @property
    def tokens(self) -> list[int]:
        """Every token the cache holds."""
        return self.prompt[:self.pos] + self.fed

    @property
    def plain(self) -> bool:
        """Whether its draw is the argmax of its logits alone (mlx-lm's greedy sampler, no
        processors, no log-probability tap): rows of such runs draw together (`argmax_rows`)."""
        return self.sampler is greedy_sampler and not self.processors

    def draw(self, logits: mx.array, history: list[int] | None = None) -> mx.array:
        """The next token from `logits` (lazy): its processors (penalties, a grammar's mask)
        on `history` (default: what the cache holds), then its sampler."""
        if self.processors:
            tokens = mx.array(self.prompt + self.fed if history is None else history)
            for proc in self.processors:
                logits = proc(tokens, logits)
        return self.sampler(logits - mx.logsumexp(logits, keepdims=True))

    def wants_feed(self) -> bool:
        """Whether its next step feeds the token it sampled last (it goes on decoding)."""
        return (self.pending is not None and self.sampled < self.max_tokens
                and not self.broken and not self.should_stop())

    def release(self) -> None:
        """Let go of its arrays once it has ended (the store holds what it keeps of the cache):
        a finished job's objects refer to one another (its scheduler slot, its pacing, its
        stop check), so whatever they reach waits for Python's cycle collector, which runs
        seldom in a worker that allocates few Python objects: measured, ~12 MiB of a finished
        request's KV buffers on the built-in model, GBs over a few dozen requests."""
        self.cache = []
        self.hidden = None
        self.stop_mark = None
        if self.spec is not None:
            self.spec.release()

    def settle(self) -> None:
        """Take its cache back from a batch it decoded in (before it steps alone or ends)."""
        if self.batch is not None:
            self.batch.leave(self)

