"""The `Backend` contract every backend kind implements, and the types it exchanges.

A backend is started only through `ensure_ready()`; callers never inspect its state and then
act. `forward()` is an async context manager: the upstream request lives exactly as long as
the `async with` block, so leaving it early (client gone, error) closes the upstream request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from prefixd.backends.llama import LlamaSlots


class BackendUnavailable(Exception):
    """The backend cannot take requests now (down, starting failed, shut down). → 503."""


class BackendError(Exception):
    """The upstream failed while serving (unreachable, crashed, reset). → 502."""


class BackendGone(BackendError):
    """The upstream did not take the request: its connection was refused or could not be made,
    or it closed it before any response byte (killed, restarting). No answer was started, so
    another backend may take the request. → 502 when none can."""


class BackendTimeout(BackendError):
    """The upstream did not answer (its headers, or the rest of its body) in time. → 504."""


@dataclass(frozen=True)
class UpstreamRequest:
    """What the proxy asks a backend to do: POST `path` with `body` (already final bytes)."""

    path: str                      # "/v1/chat/completions" or "/v1/completions"
    body: bytes
    stream: bool
    request_id: str
    headers: dict[str, str] = field(default_factory=dict)  # pass-through (e.g. session ids)
    timeout_s: float = 1800.0


@dataclass
class UpstreamResponse:
    """An upstream answer in flight: status and headers now, the body as chunks."""

    status: int
    headers: dict[str, str]
    chunks: AsyncIterator[bytes]


@dataclass
class BackendStatus:
    name: str
    kind: str
    state: str
    up: bool
    models: list[str]
    last_error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def available(self) -> bool:
        """Up, or a managed worker that ensure_ready() would start (stopped, idle-unloaded)."""
        return self.up or self.state in ("stopped", "starting")


@runtime_checkable
class Backend(Protocol):
    name: str
    models: list[str]

    async def ensure_ready(self) -> None:
        """Return when the backend can take a request; start it if needed.
        Raises `BackendUnavailable` with a reason a user can act on."""

    def forward(self, request: UpstreamRequest) -> AbstractAsyncContextManager[UpstreamResponse]:
        """Send one request. Raises `BackendError` if the upstream cannot be reached; while
        iterating `chunks`, a broken upstream raises `BackendError` too."""

    def status(self) -> BackendStatus:
        """A snapshot for /status, /ready and the metrics."""

    async def stop(self) -> None:
        """Stop health probes and any managed process; bounded in time."""

    # --- optional capabilities: `BackendBase` gives each a default -------------------------
    async def tokenize(self, body: dict[str, Any]) -> list[int] | None:
        """The exact prompt token ids of a chat/completions body as this backend renders
        it, or None when it cannot tell (now). Must not wait behind generation."""

    async def metrics_text(self) -> str | None:
        """The backend's own Prometheus text (a managed worker's cache metrics), or None."""

    async def cache_info(self) -> dict[str, Any] | None:
        """A summary of the backend's prompt cache (bytes, budget, entries), or None."""

    def slots(self) -> LlamaSlots | None:
        """The upstream's slots where it has and reports them (llama-server), else None."""


class BackendBase:
    """Defaults for the optional capabilities of `Backend`: none of them."""

    async def tokenize(self, body: dict[str, Any]) -> list[int] | None:
        return None

    async def metrics_text(self) -> str | None:
        return None

    async def cache_info(self) -> dict[str, Any] | None:
        return None

    def slots(self) -> LlamaSlots | None:
        return None
