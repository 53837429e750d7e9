"""The `Backend` contract every backend kind implements, and the types it exchanges.

A backend is started only through `ensure_ready()`; callers never inspect its state and then
act. `forward()` is an async context manager: the upstream request lives exactly as long as
the `async with` block, so leaving it early (client gone, error) closes the upstream request.

What a kind can do beyond that is typed, never probed: `capabilities` (static facts routing
decides on), and accessors that return a facet or None — `worker()` (how to reach a prefixd
worker's own endpoints now), `slot_info()`/`fetch_slots()` (an upstream with parallel slots:
llama-server), `slot_keeper()` (a managed llama-server's slots), `managed()` (a worker
process the model pool loads and unloads),
`context_window()` (the model's window in tokens, when known). One `BackendState` vocabulary
serves every kind, routing and the status page.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import aiohttp

    from prefixd.backends.config import BackendConfig
    from prefixd.backends.llama.info import ServerInfo, SlotState
    from prefixd.backends.llama.keeper import SlotKeeper


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


class BackendState(StrEnum):
    """Every kind's state, one vocabulary (the status page and `/ready` show these)."""

    UNKNOWN = "unknown"       # an upstream not probed yet
    READY = "ready"
    DOWN = "down"             # an upstream that does not answer its health probe
    STOPPED = "stopped"       # a managed worker not running: the next request starts it
    STARTING = "starting"
    STOPPING = "stopping"
    FAILED = "failed"         # a managed worker that could not start (retried later)
    SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class Capabilities:
    """What a backend kind can do, for routing to decide on (static per kind)."""

    moves_state: bool = False       # a prefixd worker: exports and imports prefix states
    restarts_itself: bool = False   # a managed worker: after its process died, ensure_ready()
    #                                 brings up its successor (a request may wait for it)
    partitions_cache: bool = False  # a prefixd worker: keeps each cache namespace apart
    #                                 (`X-Prefixd-Cache-Namespace`, per-key isolation)


@dataclass(frozen=True)
class WorkerLink:
    """How to reach a prefixd worker's own endpoints now (tokenize, metrics, cache, state
    export/import): its HTTP session, base URL and auth headers."""

    session: aiohttp.ClientSession
    base: str
    auth: dict[str, str]


@dataclass
class BackendStatus:
    name: str
    kind: str
    state: BackendState
    up: bool
    models: list[str]
    last_error: str | None = None
    # changes whenever the backend's prompt cache was lost (a worker restarted); routing
    # forgets what it believed the backend holds
    generation: int = 0
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def available(self) -> bool:
        """Up, or a managed worker that ensure_ready() would start (stopped, idle-unloaded)."""
        return self.up or self.state in (BackendState.STOPPED, BackendState.STARTING)


class Managed(Protocol):
    """A backend whose worker process the model pool loads and unloads (`backends/managed`)."""

    name: str
    config: BackendConfig
    model_spec: str | None
    cache_budget: int | None
    extra_bytes: int            # memory a load takes beyond weights and cache (llama: its KV)

    @property
    def loaded(self) -> bool: ...
    @property
    def ready(self) -> bool: ...
    @property
    def busy(self) -> bool: ...
    async def ensure_ready(self) -> None: ...
    async def settle(self) -> None: ...
    async def unload(self, why: str, reason: str, timeout: float = 60.0) -> None: ...
    def join_pool(self, may_start: Callable[[], bool]) -> None: ...
    def set_cache_bytes(self, n: int) -> None: ...
    async def cache_info(self) -> dict[str, Any] | None: ...


@runtime_checkable
class Backend(Protocol):
    name: str
    kind: str
    models: list[str]
    capabilities: Capabilities

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

    # --- optional facets: `BackendBase` gives each a default ---------------------------------
    async def tokenize(self, body: dict[str, Any]) -> list[int] | None:
        """The exact prompt token ids of a chat/completions body as this backend renders
        it, or None when it cannot tell (now). Must not wait behind generation."""

    async def metrics_text(self) -> str | None:
        """The backend's own Prometheus text (a managed worker's cache metrics), or None."""

    async def cache_info(self) -> dict[str, Any] | None:
        """A summary of the backend's prompt cache (bytes, budget, entries), or None."""

    def worker(self) -> WorkerLink | None:
        """A prefixd worker's endpoints, reachable now; None for other kinds or while down."""

    def slot_info(self) -> ServerInfo | None:
        """An upstream with parallel slots that reports them (llama-server's `/props`), as
        detected since it last came up; None otherwise."""

    async def fetch_slots(self) -> list[SlotState]:
        """Its slots now (`GET /slots`); empty when it has none or cannot tell."""

    def slot_keeper(self) -> SlotKeeper | None:
        """A managed llama-server's slot keeper (every request pinned to the slot holding its
        prefix, slot files saved and restored), for its current process; None otherwise."""

    def managed(self) -> Managed | None:
        """This backend as a worker process the model pool manages, or None."""

    async def context_window(self) -> int | None:
        """The model's context window in tokens (prompt and answer together): the backend's
        configured `context_window`, else what the backend reports of itself (a
        llama-server's per-slot `n_ctx`, a prefixd worker's `context_length`); None when
        unknown. Answers from what was learned when the backend came up, asking it at most
        once per up period, bounded in time."""


class BackendBase:
    """Defaults for the optional facets of `Backend`: none of them."""

    capabilities = Capabilities()

    async def tokenize(self, body: dict[str, Any]) -> list[int] | None:
        return None

    async def metrics_text(self) -> str | None:
        return None

    async def cache_info(self) -> dict[str, Any] | None:
        return None

    def worker(self) -> WorkerLink | None:
        return None

    def slot_info(self) -> ServerInfo | None:
        return None

    async def fetch_slots(self) -> list[SlotState]:
        return []

    def slot_keeper(self) -> SlotKeeper | None:
        return None

    def managed(self) -> Managed | None:
        return None

    async def context_window(self) -> int | None:
        return None
