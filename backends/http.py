"""HTTP forwarding shared by every backend kind: POST a request upstream, expose the answer
as an `UpstreamResponse` whose chunks arrive as the upstream sends them (never buffered).

Leaving the `post_stream` block before the body ended closes the connection, which is how
a client disconnect stops the upstream's generation at once.

A request that went out on a pooled keep-alive connection the upstream had already closed
fails before any response byte; it is sent again once, on a new connection. Nothing is sent
again after a response byte, nor after a failure on a new connection. Upstreams close pooled
connections more often than their `Keep-Alive` header says: cpp-httplib (llama-server) after
its idle timeout, and llama-server after *every streamed answer* (its stream ends by telling
cpp-httplib to stop, which closes the connection). The next request can take that connection
from the pool before the event loop has read the close, and then fails in one of three ways:
"server disconnected" or "connection reset" while waiting for the answer, or "Can not write
request body" (errno None: the transport was closing, or was lost, while the body was being
written). llama-server had stopped serving that connection before the request reached it,
so the request never ran there.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from types import SimpleNamespace

import aiohttp

from prefixd.backends.base import (
    BackendError,
    BackendGone,
    BackendTimeout,
    UpstreamRequest,
    UpstreamResponse,
)
from prefixd.metrics.proxy import UPSTREAM_RESENDS

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive",
                "content-encoding"}
_RESET_ERRNOS = {errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED}

log = logging.getLogger("prefixd.backend")


def _describe(e: BaseException) -> str:
    return str(e) or type(e).__name__


def dropped(e: BaseException | None) -> bool:
    """The upstream closed or reset a connection that had been set up (not a refused or
    failed connect): raised before the response started, no response byte was read.
    aiohttp reports a body it could not write as a `ClientOSError` without errno whose cause
    is the connection error (a write to a closing transport, a lost connection)."""
    if e is None or isinstance(e, aiohttp.ClientConnectorError):
        return False
    return any(
        isinstance(x, aiohttp.ServerDisconnectedError)
        or (isinstance(x, ConnectionError) and not isinstance(x, ConnectionRefusedError))
        or (isinstance(x, aiohttp.ClientOSError) and x.errno in _RESET_ERRNOS)
        for x in (e, e.__cause__))


class _Attempt:
    """One send of a request; `reused`: it went out on a pooled connection (seen by the
    session's `reuse_tracer`; sessions without it never report reuse, so never resend)."""

    def __init__(self) -> None:
        self.reused = False


async def _on_reuse(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: object) -> None:
    if isinstance(ctx.trace_request_ctx, _Attempt):
        ctx.trace_request_ctx.reused = True


def reuse_tracer() -> aiohttp.TraceConfig:
    """Lets `post_stream` tell a request on a pooled connection from one on a new one."""
    tc = aiohttp.TraceConfig()
    tc.on_connection_reuseconn.append(_on_reuse)
    return tc


async def _send(session: aiohttp.ClientSession, url: str, req: UpstreamRequest, backend: str,
                send: dict[str, str], stack: AsyncExitStack) -> aiohttp.ClientResponse:
    """POST until the response starts; once more, on a new connection (a session entered
    on `stack`), if a stale pooled connection dropped the request."""
    timeout = aiohttp.ClientTimeout(total=req.timeout_s, sock_connect=10)
    for resend in (False, True):
        attempt = _Attempt()
        try:
            return await session.post(url, data=req.body, headers=send, timeout=timeout,
                                      auto_decompress=True, trace_request_ctx=attempt)
        except aiohttp.ConnectionTimeoutError as e:
            raise BackendGone(f"backend {backend!r} unreachable: connect timed out") from e
        except TimeoutError as e:
            raise BackendTimeout(f"backend {backend!r} sent no response within "
                                 f"{req.timeout_s:g}s") from e
        except (aiohttp.ClientError, OSError) as e:
            if isinstance(e, aiohttp.ClientConnectorError):   # no connection: nothing sent
                raise BackendGone(f"backend {backend!r} unreachable: {_describe(e)}") from e
            if resend or not (attempt.reused and dropped(e)):
                # closed before any response byte on a new connection: the server is gone
                kind = BackendGone if dropped(e) else BackendError
                raise kind(f"backend {backend!r} unreachable: {_describe(e)}") from e
            log.info("backend %s: a pooled connection was closed under request %s (%s); "
                     "sending it again on a new connection", backend, req.request_id,
                     _describe(e))
            UPSTREAM_RESENDS.labels(backend).inc()
            session = await stack.enter_async_context(_new_connection_like(session))
    raise AssertionError("unreachable")


def _new_connection_like(session: aiohttp.ClientSession) -> aiohttp.ClientSession:
    """A session to the same kind of endpoint as `session` (see `client_session`) that
    opens a new connection for its one request: other pooled connections may be stale too."""
    pooled = session.connector
    connector: aiohttp.BaseConnector = (
        aiohttp.UnixConnector(path=pooled.path, force_close=True)
        if isinstance(pooled, aiohttp.UnixConnector) else aiohttp.TCPConnector(force_close=True))
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


@asynccontextmanager
async def post_stream(session: aiohttp.ClientSession, url: str, req: UpstreamRequest,
                      backend: str, headers: dict[str, str] | None = None,
                      ) -> AsyncIterator[UpstreamResponse]:
    """POST `req.body` to `url`; yield the response with its body as an async iterator."""
    send = {"Content-Type": "application/json", **req.headers, **(headers or {})}
    async with AsyncExitStack() as stack:
        resp = await _send(session, url, req, backend, send, stack)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for data in resp.content.iter_any():
                    yield data
            except TimeoutError as e:
                raise BackendTimeout(f"backend {backend!r} timed out after "
                                     f"{req.timeout_s:g}s") from e
            except (aiohttp.ClientError, OSError) as e:
                raise BackendError(f"backend {backend!r} connection lost: "
                                   f"{_describe(e)}") from e

        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
        try:
            yield UpstreamResponse(status=resp.status, headers=out_headers, chunks=chunks())
        finally:
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()  # drop the connection: the upstream sees the disconnect now


def client_session(unix_socket: str | None = None, limit: int = 64) -> aiohttp.ClientSession:
    """One pooled session per backend (TCP, or a unix socket for a local worker)."""
    connector: aiohttp.BaseConnector
    if unix_socket:
        connector = aiohttp.UnixConnector(path=unix_socket, limit=limit)
    else:
        connector = aiohttp.TCPConnector(limit=limit, ttl_dns_cache=300)
    return aiohttp.ClientSession(connector=connector, auto_decompress=True,
                                 timeout=aiohttp.ClientTimeout(total=None),
                                 trace_configs=[reuse_tracer()])
