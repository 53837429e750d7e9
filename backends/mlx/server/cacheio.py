"""The worker's state-move endpoints at the HTTP edge: `POST /v1/cache/export` signs what it
sends, `POST /v1/cache/import` treats what it receives as untrusted input.

Owns: the import's order of refusals, each before anything is stored and each a 4xx OpenAI
error with a named code, counted in `prefixd_worker_cache_imports_total{outcome}`:
- 403 `no_transfer_secret`: this worker has no `transfer_secret`, so it can authenticate no
  bundle (refused before the body is read);
- 403 `unsigned_bundle`: no well-formed `X-Prefixd-Bundle-Mac` header (before the body is read);
- 413 `too_large`: a Content-Length, or a streamed body, larger than the prompt cache's RAM
  budget (the body is never buffered past it);
- 408 `request_timeout`: the body did not arrive within `body_timeout_s` (the connection is
  closed: a peer holding the worker's token cannot hold it open by trickling);
- 403 `bad_mac`: the MAC, computed chunk by chunk as the body streams in, does not verify;
- then the bundle's own checks on the generation thread (`engine/transfer/bundle.py`,
`engine/transfer/check.py`: 400
  with the reason as the code, 409 `other_model`).
The bundle format and its checks are `engine/transfer/bundle.py`'s; the MAC is `server/seal.py`'s.
"""

from __future__ import annotations

from aiohttp import web
from pydantic import SecretStr

from prefixd.api.errors import ApiError
from prefixd.api.reading import within
from prefixd.api.schema import cache_namespace
from prefixd.backends.mlx.engine.loading import Loaded
from prefixd.backends.mlx.engine.transfer import bundle
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.scheduler.jobs import WorkerClosed
from prefixd.backends.mlx.server import seal
from prefixd.metrics.worker import IMPORTS

CHUNK = 1 << 20


def signed(data: bytes, pos: int, secret: SecretStr | None) -> web.Response:
    """An export's answer: the bundle, its position and, with a secret, its MAC."""
    headers = {"X-Prefixd-Tokens": str(pos)}
    if secret is not None:
        headers[seal.HEADER] = seal.sign(secret.get_secret_value(), data)
    return web.Response(body=data, content_type="application/octet-stream", headers=headers)


async def import_state(request: web.Request, loaded: Loaded, generator: Generator,
                       secret: SecretStr | None, timeout_s: float) -> web.Response:
    """A bundle another worker holding this worker's secret exported → stored in this worker's
    prompt cache (`{"tokens": N}`; 0 when its budget did not take it), or refused."""
    try:
        namespace = cache_namespace(request.headers)
        data = await _receive(request, secret, loaded.engine.store.budget, timeout_s)
        vocab = len(loaded.tokenizer)
        tokens = await generator.call(lambda e: bundle.import_(e, data, vocab, namespace))
    except bundle.BundleError as e:
        IMPORTS.labels(e.reason).inc()
        raise ApiError(e.status, f"bundle refused: {e}", code=e.reason) from None
    except ApiError as e:
        IMPORTS.labels(e.code or "refused").inc()
        raise
    except WorkerClosed:
        raise ApiError(503, "the worker is shutting down", type_="server_error") from None
    IMPORTS.labels("stored" if tokens else "not_stored").inc()
    return web.json_response({"tokens": tokens})


async def _receive(request: web.Request, secret: SecretStr | None, limit: int,
                   timeout_s: float) -> bytes:
    """The request's body, read only from a peer that can sign (a MAC header, a secret here),
    at most `limit` bytes within `timeout_s`, and returned only if its MAC verifies."""
    if secret is None:
        raise ApiError(403, "this worker has no transfer secret (PREFIXD_TRANSFER_SECRET), so "
                       "it imports no prefix states", code="no_transfer_secret")
    tag = request.headers.get(seal.HEADER)
    if not seal.well_formed(tag):
        raise ApiError(403, f"the bundle is not signed ({seal.HEADER}: 64 hex digits)",
                       code="unsigned_bundle")
    too_large = ApiError(413, f"the bundle is larger than this worker's prompt cache ({limit} "
                         "bytes)", code="too_large")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    mac = seal.signer(secret.get_secret_value())
    parts, size = [], 0
    async with within(timeout_s, request):
        async for chunk in request.content.iter_chunked(CHUNK):
            size += len(chunk)
            if size > limit:
                raise too_large
            mac.update(chunk)
            parts.append(chunk)
    if not seal.verifies(mac, tag):
        raise ApiError(403, "the bundle's MAC does not verify: it was not made by a worker "
                       "holding this worker's transfer secret, or was altered", code="bad_mac")
    return b"".join(parts)
