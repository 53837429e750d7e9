"""HTTP forwarding shared by every backend kind: POST a request upstream, expose the answer
as an `UpstreamResponse` whose chunks arrive as the upstream sends them (never buffered).

Leaving the `post_stream` block before the body ended closes the connection, which is how
a client disconnect stops the upstream's generation at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp

from prefixd.backends.base import (
    BackendError,
    BackendTimeout,
    UpstreamRequest,
    UpstreamResponse,
)

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive",
                "content-encoding"}


def _describe(e: BaseException) -> str:
    return str(e) or type(e).__name__


@asynccontextmanager
async def post_stream(session: aiohttp.ClientSession, url: str, req: UpstreamRequest,
                      backend: str, headers: dict[str, str] | None = None,
                      ) -> AsyncIterator[UpstreamResponse]:
    """POST `req.body` to `url`; yield the response with its body as an async iterator."""
    send = {"Content-Type": "application/json", **req.headers, **(headers or {})}
    timeout = aiohttp.ClientTimeout(total=req.timeout_s, sock_connect=10)
    try:
        resp = await session.post(url, data=req.body, headers=send, timeout=timeout,
                                  auto_decompress=True)
    except aiohttp.ConnectionTimeoutError as e:
        raise BackendError(f"backend {backend!r} unreachable: connect timed out") from e
    except TimeoutError as e:
        raise BackendTimeout(f"backend {backend!r} sent no response within "
                             f"{req.timeout_s:g}s") from e
    except (aiohttp.ClientError, OSError) as e:
        raise BackendError(f"backend {backend!r} unreachable: {_describe(e)}") from e

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for data in resp.content.iter_any():
                yield data
        except TimeoutError as e:
            raise BackendTimeout(f"backend {backend!r} timed out after {req.timeout_s:g}s") from e
        except (aiohttp.ClientError, OSError) as e:
            raise BackendError(f"backend {backend!r} connection lost: {_describe(e)}") from e

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
                                 timeout=aiohttp.ClientTimeout(total=None))
