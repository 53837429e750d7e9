"""parse: read the client's bytes (size-capped, decompressed by aiohttp) and decode JSON.
Every failure is a 400/413 in the client API's error shape."""

from __future__ import annotations

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from prefixd.api.errors import ApiError
from prefixd.api.schema import decode_json
from prefixd.proxy.exchange import Exchange
from prefixd.proxy.stages import Next


class ParseStage:
    name = "parse"

    def __init__(self, max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        ex.raw = await self._read(ex.request)
        body = decode_json(ex.raw)
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_body")
        ex.client_body = body
        await call_next(ex)

    async def _read(self, request: web.Request) -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"request body is larger than max_body_bytes="
                           f"{self.max_body_bytes}", code="request_too_large") from None
        except (ValueError, RequestPayloadError, HttpProcessingError, web.HTTPException) as e:
            raise ApiError(400, f"could not read the request body: {e}",
                           code="invalid_body") from None
