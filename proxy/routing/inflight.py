"""What each backend is computing now, as far as this proxy knows: the requests it sent there
(past their queue slot) and their prefix chains, each with an event set when it ends.

Keyed by attempt (`proxy/attempt.py`). Two readers: the transfer plan (a prefixd worker
computing a prefix is a source to copy it from once it is done) and the prefix wait (a
request for a llama-server that is computing a long prefix it shares waits for it, then
reuses it through the server's RAM prompt cache, instead of computing it again in another
slot). Pure bookkeeping; the router owns one.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from prefixd.proxy.routing.index import Chain


def shared(a: Chain, b: Chain) -> int:
    """Estimated tokens of the longest common boundary prefix of two chains."""
    depth = 0
    for x, y in zip(a.bounds, b.bounds, strict=False):
        if x.key != y.key:
            break
        depth += 1
    return a.bounds[depth - 1].tokens if depth else 0


class InFlight:
    def __init__(self) -> None:
        # backend -> attempt -> (its chain, set when it ends there)
        self._by_backend: dict[str, dict[Any, tuple[Chain, asyncio.Event]]] = \
            collections.defaultdict(dict)

    def add(self, backend: str, request: Any, chain: Chain) -> None:
        self._by_backend[backend][request] = (chain, asyncio.Event())

    def remove(self, backend: str, request: Any) -> None:
        """It ended there (answered, failed, or sent elsewhere): its waiters go on."""
        entry = self._by_backend[backend].pop(request, None)
        if entry is not None:
            entry[1].set()

    def requests(self, backend: str) -> list[Any]:
        return list(self._by_backend.get(backend, {}))

    def computing(self, backend: str, chain: Chain) -> tuple[int, asyncio.Event | None]:
        """(estimated tokens of `chain`'s prefix that a request sent to `backend` shares with
        it, the most of any; that request's end event): only attempts past their queue slot
        (`admitted`), since one still waiting in the proxy runs later."""
        best, event = 0, None
        for request, (other, done) in self._by_backend.get(backend, {}).items():
            if not request.admitted:
                continue
            tokens = shared(chain, other)
            if tokens > best:
                best, event = tokens, done
        return best, event
