"""canonicalize, detect and measure: the proxy's prefix stages over one `PrefixTracker`
(lanes, rules, reports; `proxy/prefix`). Canonicalization runs whether or not detection
does; detection reports before forwarding and reconciles with the backend's usage after.
The request becomes its lane's turn when a backend accepts it (relay commits it); one that
ends before that is only counted as unserved."""

from __future__ import annotations

from prefixd.proxy.exchange import Exchange
from prefixd.proxy.prefix.tracker import PrefixTracker
from prefixd.proxy.stages import Next


class CanonicalizeStage:
    name = "canonicalize"

    def __init__(self, prefix: PrefixTracker) -> None:
        self.prefix = prefix

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        assert ex.parsed is not None
        ex.prepared = prepared = self.prefix.canonicalize(ex.parsed.body, ex.request.headers,
                                                          ex.namespace)
        try:
            await call_next(ex)
        finally:
            if not prepared.served:
                self.prefix.unserved(prepared)


class DetectStage:
    name = "detect"

    def __init__(self, prefix: PrefixTracker) -> None:
        self.prefix = prefix

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        if ex.prepared is not None:
            self.prefix.detect(ex.prepared)
        await call_next(ex)
        if ex.prepared is not None and ex.attempt is not None and ex.attempt.completed:
            self.prefix.record_response(ex.prepared, ex.attempt.message, ex.attempt.usage)


class MeasureStage:
    """Exact token offsets for a mutated turn, from the attempt's backend's tokenizer, before
    the request takes a queue slot (a backend that cannot tokenize now is skipped)."""

    name = "measure"

    def __init__(self, prefix: PrefixTracker) -> None:
        self.prefix = prefix

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        if ex.prepared is not None and ex.attempt is not None:
            await self.prefix.measure(ex.prepared, ex.attempt.tokenize)
        await call_next(ex)
