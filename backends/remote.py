"""Backend kind `prefixd`: a `prefixd worker` that runs elsewhere (another Mac), reached over
HTTP with its API key. Routed like a managed worker — exact tokenization for prefix reports,
its cache metrics and cache summary — minus process management: its owner starts it."""

from __future__ import annotations

from typing import Any

from prefixd.backends.openai import OpenAIBackend
from prefixd.backends.worker_api import WorkerEndpoints, call


class RemoteWorkerBackend(WorkerEndpoints, OpenAIBackend):
    kind = "prefixd"

    async def _call(self, path: str, payload: dict | None = None, text: bool = False) -> Any:
        return await call(self._ensure_session(), self._base + path, self._auth, payload, text)
