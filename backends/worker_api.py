"""Calls to a prefixd worker's own endpoints (`/tokenize`, `/metrics`, `/v1/cache`), shared
by the managed backend (a local worker it runs) and the `prefixd` backend (a remote one).
Every call is bounded in time and answers None when the worker cannot tell."""

from __future__ import annotations

from typing import Any

import aiohttp


class WorkerEndpoints:
    """The Backend capabilities a prefixd worker answers itself, for a backend class that
    defines `_call(path, payload=None, text=False)` (how it reaches its worker). Listed before
    `BackendBase` in the bases, so these replace its defaults."""

    async def _call(self, path: str, payload: dict | None = None, text: bool = False) -> Any:
        raise NotImplementedError

    async def tokenize(self, body: dict) -> list[int] | None:
        """The worker's exact prompt ids for a chat or completions body (rendered through its
        chat template, no boundaries), for exact prefix-report offsets; None when it cannot
        tell now."""
        return token_ids(await self._call("/tokenize", tokenize_payload(body)))

    async def metrics_text(self) -> str | None:
        """The worker's own /metrics (its prompt cache), or None when it cannot answer."""
        return await self._call("/metrics", text=True)

    async def cache_info(self) -> dict | None:
        """The worker's /v1/cache (its checkpoint store and disk tier), or None."""
        answer = await self._call("/v1/cache")
        return answer if isinstance(answer, dict) else None


def tokenize_payload(body: dict[str, Any]) -> dict[str, Any]:
    """A chat or completions body as a `/tokenize` request: ids only, no boundaries."""
    if isinstance(body.get("prompt"), str):
        return {"content": body["prompt"]}
    return {**body, "boundaries": False}


def token_ids(answer: Any) -> list[int] | None:
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    return tokens if isinstance(tokens, list) else None


async def call(session: aiohttp.ClientSession, url: str, auth: dict[str, str],
               payload: dict[str, Any] | None = None, text: bool = False,
               timeout_s: float = 10.0) -> Any:
    """GET (or POST `payload` to) `url`: its JSON (or text), None on any failure."""
    method = session.get if payload is None else session.post
    try:
        async with method(url, json=payload, headers=auth,
                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return None
            return await r.text() if text else await r.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return None
