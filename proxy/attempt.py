"""One try at serving a request on one backend. Failover is an explicit loop over attempts
(`proxy/stages/route.py`): each gets a fresh `Attempt`, so nothing of an earlier try needs
resetting, and the stages that run per attempt (measure, queue, load, transfer, forward,
relay) read and write only it and the request's response state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixd.api.usage import Usage
from prefixd.backends.base import Backend, UpstreamResponse
from prefixd.proxy.queue import Slot

if TYPE_CHECKING:
    from prefixd.proxy.routing.policy import Decision
    from prefixd.proxy.routing.slots import Placement
    from prefixd.proxy.translate.base import StreamTranslator


@dataclass(frozen=True)
class TransferPlan:
    """Copy `tokens` of a request's prefix from `source` first; `computing`: the end of the
    source's request computing it (None when the source holds it already), which the copy
    waits for (a worker exports what its finished requests left)."""

    source: str
    tokens: int
    computing: asyncio.Event | None = None


@dataclass(frozen=True)
class Clamp:
    """The client's `max_tokens` cut to the room its prompt leaves in the backend's window."""

    asked: int
    sent: int
    window: int

    def header(self) -> str:
        return f"clamped from {self.asked} to {self.sent} (window {self.window})"


@dataclass(eq=False)       # identity-hashed: routing keeps the attempts in flight
class Attempt:
    decision: Decision
    backend: Backend
    model: str = ""                              # the served model it is sent as
    again: bool = False                          # an earlier attempt's backend took nothing
    stream_out: StreamTranslator | None = None   # the client API's stream state, if any
    transfer: TransferPlan | None = None         # copy that prefix in first
    transferred: int = 0                         # tokens of prefix state copied in
    placement: Placement | None = None           # a llama-server's slot plan
    slot: Slot | None = None                     # its backend's queue slot, once held
    queue_wait: float | None = None              # seconds it waited for that slot
    upstream: UpstreamResponse | None = None
    message: dict[str, Any] | None = None        # the assistant's answer, for the lane
    usage: Usage | None = None                   # what the backend reported
    completed: bool = False                      # a 200 answer went out whole
    clamp: Clamp | None = None                   # max_tokens cut to the window's room
    prompt_tokens: int | None = None             # the prompt's size as counted before sending
    _counted: list[tuple[dict, list[int] | None]] = field(default_factory=list, repr=False)

    @property
    def admitted(self) -> bool:
        """It holds its queue slot: the backend is (about to be) computing it."""
        return self.slot is not None

    async def tokenize(self, body: dict) -> list[int] | None:
        """`backend.tokenize(body)` under the served model's name (not the client's alias),
        asked once per attempt for one body (the measure and window stages both count the
        forwarded prompt)."""
        for seen, ids in self._counted:
            if seen is body:
                return ids
        ids = await self.backend.tokenize({**body, "model": self.model} if self.model
                                          else body)
        self._counted.append((body, ids))
        return ids

    def counted(self, body: dict, ids: list[int]) -> None:
        """`body`'s token ids, counted already by a backend of the same model (routing counts
        them when it follows KV events): `tokenize` does not ask again."""
        self._counted.append((body, ids))

    def release(self) -> None:
        """The attempt is over: its queue slot goes to the next request."""
        if self.slot is not None:
            self.slot.release()
