"""Every request body is read with a deadline (the proxy's routes and the worker's, a streamed
state import included): a client that sends its headers and then trickles or stalls its body
(slowloris, also one holding the worker's token) gets a 408 `request_timeout` after
`body_timeout_s` and its connection is closed after that answer (at most 1 s of lingering
read, so the client reads the answer before the close).

Owns: `within` (a deadline around any body read), `read_body` (a whole body) and
`body_deadline` (the worker's middleware: a POST's body read before its handler runs, except
on routes that stream their body themselves, inside `within`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from prefixd.api.errors import ApiError
from prefixd.api.protocol import TimedHandler

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def within(timeout_s: float, request: web.Request) -> AsyncIterator[None]:
    """Run `request`'s body read inside: 408 `request_timeout` if it takes longer than
    `timeout_s`, and the connection closed right after that answer (`protocol.TimedHandler`)."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:
        if isinstance(request.protocol, TimedHandler):
            request.protocol.cut()
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g}s",
                       code="request_timeout") from None


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body (`request.read()`: at most the app's `client_max_size`), in time."""
    async with within(timeout_s, request):
        return await request.read()


def body_deadline(timeout_s: float, streamed: frozenset[str] = frozenset()) -> Middleware:
    """Read every POST body (but on the `streamed` paths) within `timeout_s` before its
    handler runs; the handler's own `request.read()` then returns it at once."""

    @web.middleware
    async def deadline(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST" and request.path not in streamed:
            await read_body(request, timeout_s)
        return await handler(request)

    return deadline
