"""Backend kind `prefixd`: a `prefixd worker` that runs elsewhere (another Mac), reached over
HTTP with its API key. Routed like a managed worker — exact tokenization for prefix reports,
its cache metrics and cache summary — minus process management: its owner starts it."""

from __future__ import annotations

import aiohttp

from prefixd.backends.openai import OpenAIBackend


class RemoteWorkerBackend(OpenAIBackend):
    kind = "prefixd"

    async def tokenize(self, body: dict) -> list[int] | None:
        """The worker's exact prompt ids (`/tokenize`, no boundary rendering)."""
        payload = ({"content": body["prompt"]} if isinstance(body.get("prompt"), str)
                   else {**body, "boundaries": False})
        answer = await self._get_or_post("/tokenize", payload)
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return tokens if isinstance(tokens, list) else None

    async def metrics_text(self) -> str | None:
        session = self._ensure_session()
        try:
            async with session.get(self._base + "/metrics", headers=self._auth,
                                   timeout=aiohttp.ClientTimeout(total=5)) as r:
                return await r.text() if r.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    async def cache_info(self) -> dict | None:
        answer = await self._get_or_post("/v1/cache", None)
        return answer if isinstance(answer, dict) else None

    async def _get_or_post(self, path: str, payload: dict | None) -> object:
        session = self._ensure_session()
        method = session.get if payload is None else session.post
        try:
            async with method(self._base + path, json=payload, headers=self._auth,
                              timeout=aiohttp.ClientTimeout(total=10)) as r:
                return await r.json(content_type=None) if r.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None
