"""The prefix index: which backend holds which prompt prefix, as far as the proxy knows.

A request is a chain of boundaries over its canonical (post-canonicalization) render order —
model, tools, system, then message by message (`proxy/prefix/segments.py`). Each boundary
has a key, the hash of everything before it, and a token count (exact where the backend
reported or tokenized it, else estimated from characters). After a backend served a request,
its boundaries are recorded for that backend; the next request's boundaries are looked up to
find, per backend, the longest prefix it holds. Entries expire (TTL), are capped in count
(least recently used go first), and are dropped when a backend restarts.

A backend that restores only some prefixes (a prefixd worker on a hybrid model restores
recurrent state at its checkpoints, not anywhere) says which ones after each request
(`Restorable`): each boundary is then recorded with the tokens the backend restores for it, the
largest restorable position at or below it, or not at all. Without that digest (llama-server,
vLLM, any OpenAI upstream) or when any prefix restores, every boundary is taken as restorable.

Pure data, no I/O: the router owns one `PrefixIndex` and feeds it.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prefixd.api.values import count
from prefixd.proxy.prefix.segments import Segment

MAX_DIGEST = 1024         # positions read of a worker's restorable digest (a worker sends 64)
NEAR = 0.1                # an estimated boundary lies within this share of the true one


@dataclass(frozen=True, slots=True)
class Boundary:
    key: str          # hash of the render order up to here
    tokens: int       # prompt tokens before this boundary (estimated unless exact)


@dataclass(frozen=True, slots=True)
class Chain:
    bounds: list[Boundary]
    head: int         # bounds[:head] end with the first user message: the conversation's own

    @property
    def key(self) -> str:
        """What stays the same across a conversation's turns (tools, system, first user
        message): spreads new conversations consistently."""
        return self.bounds[self.head - 1].key if self.head else ""


def boundaries(segments: Iterable[Segment], chars_per_token: float = 4.0,
               namespace: str = "") -> Chain:
    """The chain of a request: one boundary after each rendered segment (the model and the
    sampling parameters enter the hash but hold no tokens). `namespace` (per-key isolation)
    seeds the hash: no boundary of one partition is ever another's."""
    out: list[Boundary] = []
    h = hashlib.blake2b(namespace.encode(), digest_size=12)
    chars, head = 0, 0
    for seg in segments:
        h.update(seg.region.encode())
        h.update(seg.kind.encode())
        h.update(seg.text.encode("utf-8", "surrogatepass"))
        if not seg.rendered:
            continue
        chars += len(seg.text)
        out.append(Boundary(h.copy().hexdigest(), round(chars / chars_per_token)))
        if not head and seg.region == "messages" and seg.role == "user" and seg.kind != "meta":
            head = len(out)
    return Chain(out, head or len(out))


@dataclass(frozen=True, slots=True)
class Restorable:
    """What a backend said it can restore of the request it just served: `positions`
    (ascending token counts), and every prefix up to `prefix_to` (a state that trims back)."""

    positions: tuple[int, ...]
    prefix_to: int = 0
    boundaries: tuple[int, ...] = ()   # where its messages start or end (a newer worker's)

    @classmethod
    def from_digest(cls, worker: Mapping[str, Any] | None) -> Restorable | None:
        """A prefixd worker's digest (`usage.prefixd.restorable`: `positions`, `prefix_to`,
        `any_prefix`); None when there is none, it is malformed, or any prefix restores (then
        every boundary counts, as for any other backend)."""
        digest = worker.get("restorable") if worker is not None else None
        if not isinstance(digest, dict) or digest.get("any_prefix") is True:
            return None
        positions = digest.get("positions")
        if not isinstance(positions, list) or len(positions) > MAX_DIGEST:
            return None
        counts = [count(p) for p in positions]
        prefix_to = count(digest.get("prefix_to", 0))
        if prefix_to is None or any(c is None for c in counts):
            return None
        marks = digest.get("boundaries", [])
        marks = [count(m) for m in marks] if isinstance(marks, list) and \
            len(marks) <= MAX_DIGEST else []
        return cls(tuple(sorted(c for c in counts if c)), prefix_to,
                   tuple(sorted(m for m in marks if m)))

    def at(self, tokens: int, slack: int, estimated: bool = False) -> int:
        """The tokens restorable for a boundary at `tokens`: all of them up to `prefix_to`,
        else the largest position at or below `tokens + slack` (a few tokens off, e.g. a
        re-rendered tail), else `prefix_to`; 0: nothing. `estimated`: the count is an estimate
        (not the prompt's reported end), which lies past the true boundary where that part of
        the prompt tokenizes more sparsely than the whole; a message mark of the worker's
        within `NEAR` below it is where the boundary really is, and nothing past it is
        credited (a checkpoint of the turns after a shared system prompt is not the system
        prompt's)."""
        if tokens <= self.prefix_to:
            return tokens
        top = tokens + slack
        if estimated:
            marks = [m for m in self.boundaries if tokens * (1 - NEAR) <= m <= top]
            top = max(marks, default=top)
        i = bisect_right(self.positions, top)
        return max(self.positions[i - 1] if i else 0, self.prefix_to)


@dataclass(slots=True)
class _Entry:
    tokens: int
    seen: float


class PrefixIndex:
    """backend -> boundary key -> tokens; bounded per backend by count and age. Beside it, for
    the status page, backend -> conversation (lane) -> the tokens of its longest prefix held."""

    def __init__(self, max_entries: int = 100_000, ttl_s: float = 7200.0) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._by_backend: dict[str, OrderedDict[str, _Entry]] = {}
        self._convs: dict[str, OrderedDict[str, _Entry]] = {}

    def record(self, backend: str, chain: Chain, now: float,
               exact_tokens: int | None = None, restorable: Restorable | None = None,
               slack: int = 16) -> None:
        """`backend` now holds every prefix of `chain`, or, with `restorable`, what that says
        it restores of each (within `slack` tokens above a boundary's estimate); a boundary
        it restores nothing of is dropped. `exact_tokens`, when the backend reported the
        prompt's size, corrects the estimates (the last boundary is exact)."""
        table = self._by_backend.setdefault(backend, OrderedDict())
        bounds = chain.bounds
        exact = bool(exact_tokens) and bool(bounds) and bounds[-1].tokens > 0
        scale = exact_tokens / bounds[-1].tokens if exact and exact_tokens else 1.0
        for i, b in enumerate(bounds):
            tokens = round(b.tokens * scale)
            if restorable is not None:
                tokens = restorable.at(tokens, slack, not (exact and i == len(bounds) - 1))
                if tokens <= 0:
                    table.pop(b.key, None)
                    continue
            table[b.key] = _Entry(tokens, now)
            table.move_to_end(b.key)
        while len(table) > self.max_entries:
            table.popitem(last=False)

    def longest(self, chain: Chain, now: float) -> dict[str, tuple[int, bool]]:
        """backend -> (tokens of the longest prefix of `chain` it holds, whether that prefix
        reaches past the chain's head, i.e. is this conversation's own and not only a
        prefix many conversations share, such as a system prompt)."""
        out: dict[str, tuple[int, bool]] = {}
        for backend, table in self._by_backend.items():
            self._expire(table, now)
            best = (0, False)
            for depth in range(len(chain.bounds), 0, -1):
                b = chain.bounds[depth - 1]
                entry = table.get(b.key)
                if entry is not None:
                    best = (entry.tokens, depth >= chain.head)
                    entry.seen = now
                    table.move_to_end(b.key)
                    break
            out[backend] = best
        return out

    def forget(self, backend: str, chain: Chain | None = None,
               after_tokens: int = 0) -> None:
        """Drop what `backend` holds: everything (it restarted), or the boundaries of `chain`
        beyond `after_tokens` (it reported fewer cached tokens than predicted)."""
        table = self._by_backend.get(backend)
        if table is None:
            return
        if chain is None:
            table.clear()
            self._convs.pop(backend, None)
            return
        for b in chain.bounds:
            if b.tokens > after_tokens:
                table.pop(b.key, None)

    def size(self, backend: str) -> int:
        return len(self._by_backend.get(backend, ()))

    def note(self, backend: str, conversation: str, tokens: int, now: float) -> None:
        """`backend` holds `tokens` of `conversation` (its lane): what `summary` shows."""
        convs = self._convs.setdefault(backend, OrderedDict())
        convs[conversation] = _Entry(tokens, now)
        convs.move_to_end(conversation)
        while len(convs) > self.max_entries:
            convs.popitem(last=False)

    def summary(self, backend: str, now: float, top: int = 5,
                sees: Callable[[str], bool] = lambda lane: True) -> dict:
        """The conversations `backend` holds (unexpired) that `sees` lets the caller see
        (per-key isolation: its own key's), their tokens, the largest first."""
        convs = self._convs.get(backend, OrderedDict())
        self._expire(convs, now)
        held = sorted(((e.tokens, lane) for lane, e in convs.items() if sees(lane)),
                      reverse=True)
        return {"entries": self.size(backend), "conversations": len(held),
                "tokens": sum(t for t, _ in held),
                "top": [{"lane": lane, "tokens": t} for t, lane in held[:top]]}

    def _expire(self, table: OrderedDict[str, _Entry], now: float) -> None:
        while table:
            key, entry = next(iter(table.items()))
            if now - entry.seen <= self.ttl_s:
                return
            del table[key]
