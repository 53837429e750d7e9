"""The request pipeline as lists of stages, built once from Settings (`build_stages`).

A stage is a small class with one method, `async __call__(ex, call_next)`: it reads and
writes fields of the `Exchange`, then awaits `call_next(ex)` for the rest of its list (or
returns without it once it answered). A stage that must hold something while the rest runs
(a queue slot, the upstream connection) wraps `call_next` in that context; a stage that acts
on the answer does so after `call_next` returns. Switching a feature off leaves its stage out
of the list, and nothing else.

    parse → translate → canonicalize → detect → route ⟲ [measure → window → queue → load
                                                          → transfer → forward → relay]

The request's stages run once. route is the failover loop: each try on a backend is an
`Attempt` (`proxy/attempt.py`) run through the per-attempt stages, which touch only that
attempt and the request's response state, so no stage is entered twice for one attempt and
nothing is reset between attempts.

| stage | reads | writes |
|---|---|---|
| parse | the HTTP request | `raw`, `client_body` |
| translate | `client_body` | `parsed` (the internal chat/completions request) |
| canonicalize | `parsed` | `prepared` (lane, forwarded body, render order) |
| detect | `prepared` | `prepared.report`; after the answer: reconciles it with usage |
| route | `parsed.req.model`, lane, render order | `model`, `attempt` (one per backend tried) |
| measure | `prepared`, `attempt.backend` | exact token offsets (outside the queue slot) |
| window | `attempt.backend`'s window, the forwarded body | a refusal, or `attempt.clamp` |
| queue | `attempt.backend` | holds a slot (`attempt.queue_wait`); may start an SSE response |
| load | `attempt.backend` (managed) | room in the memory budget, its worker started |
| transfer | `attempt.transfer` | prefix state copied in (`attempt.transferred`) |
| forward | `attempt.backend`, the forwarded body | `attempt.upstream` (held open meanwhile) |
| relay | `attempt.upstream` | the response (a 200: the lane's turn); `attempt.message`, ... |
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from prefixd.proxy.exchange import Exchange

Next = Callable[[Exchange], Awaitable[None]]


class Stage(Protocol):
    name: str

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        """Do this stage's part, then (usually) `await call_next(ex)`."""


async def _end(ex: Exchange) -> None:
    return None


def chain(stages: list[Stage]) -> Next:
    """One callable that runs `stages` in order, each around the rest."""
    run: Next = _end
    for stage in reversed(stages):
        run = _bind(stage, run)
    return run


def _bind(stage: Stage, rest: Next) -> Next:
    async def step(ex: Exchange) -> None:
        await stage(ex, rest)
    return step
