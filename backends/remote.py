"""Backend kind `prefixd`: a `prefixd worker` that runs elsewhere (another Mac), reached over
HTTP with its API key. Routed like a managed worker — exact tokenization for prefix reports,
its cache metrics and cache summary — minus process management: its owner starts it."""

from __future__ import annotations

from typing import Any

from prefixd.backends.openai import OpenAIBackend
from prefixd.backends.worker_api import call, token_ids, tokenize_payload


class RemoteWorkerBackend(OpenAIBackend):
    kind = "prefixd"

    async def tokenize(self, body: dict) -> list[int] | None:
        """The worker's exact prompt ids (`/tokenize`, no boundary rendering)."""
        return token_ids(await self._call("/tokenize", tokenize_payload(body)))

    async def metrics_text(self) -> str | None:
        return await self._call("/metrics", text=True)

    async def cache_info(self) -> dict | None:
        answer = await self._call("/v1/cache")
        return answer if isinstance(answer, dict) else None

    async def _call(self, path: str, payload: dict | None = None, text: bool = False) -> Any:
        return await call(self._ensure_session(), self._base + path, self._auth, payload, text)
