"""parse: read the client's bytes and decode JSON. Every failure is a 4xx in the client
API's error shape: 413 past `max_body_bytes` (counted as the body arrives, after any
decompression, whether the client sent a Content-Length or chunks), 408 past
`body_timeout_s`, 400 for a body that cannot be read or is not a JSON object."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from prefixd.api.errors import ApiError
from prefixd.api.reading import within
from prefixd.api.schema import decode_json
from prefixd.proxy.exchange import Exchange
from prefixd.proxy.stages import Next

# A compressed body may inflate to at most this many times its size on the wire (a
# "zip bomb" is refused after this much work, not after max_body_bytes of it).
MAX_INFLATE_RATIO = 100


class ParseStage:
    name = "parse"

    def __init__(self, max_body_bytes: int, body_timeout_s: float) -> None:
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        async with within(self.body_timeout_s, ex.request):
            ex.raw = await self._read(ex.request)
        body = decode_json(ex.raw)
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_body")
        ex.client_body = body
        await call_next(ex)

    async def _read(self, request: web.Request) -> bytes:
        limit = self.max_body_bytes
        compressed = request.headers.get("Content-Encoding", "identity").lower() != "identity"
        if compressed and request.content_length:
            limit = min(limit, MAX_INFLATE_RATIO * request.content_length)
        parts, size = [], 0
        try:
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body is larger than {limit} bytes "
                                   f"(max_body_bytes={self.max_body_bytes}"
                                   f"{', compressed' if compressed else ''})",
                                   code="request_too_large")
                parts.append(chunk)
                if compressed:
                    await asyncio.sleep(0)      # inflating runs on the loop: let others in
        except (ValueError, RequestPayloadError, HttpProcessingError, web.HTTPException) as e:
            raise ApiError(400, f"could not read the request body: {e}",
                           code="invalid_body") from None
        return b"".join(parts)
