"""Backend kind `prefixd`: a `prefixd worker` that runs elsewhere (another Mac), reached over
HTTP with its API key. Routed like a managed worker — exact tokenization for prefix reports,
its cache metrics and cache summary, prefix state moves — minus process management: its owner
starts it."""

from __future__ import annotations

from prefixd.backends import worker_api
from prefixd.backends.base import Capabilities, WorkerLink
from prefixd.backends.config import BackendConfig
from prefixd.backends.openai import OpenAIBackend


class RemoteWorkerBackend(OpenAIBackend):
    kind = "prefixd"
    capabilities = Capabilities(moves_state=True, partitions_cache=True)

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._window = worker_api.WindowMemo()

    def worker(self) -> WorkerLink | None:
        return WorkerLink(self._ensure_session(), self._base, self._auth)

    async def tokenize(self, body: dict) -> list[int] | None:
        return await worker_api.tokenize(self.worker(), body)

    async def metrics_text(self) -> str | None:
        return await worker_api.metrics_text(self.worker())

    async def cache_info(self) -> dict | None:
        return await worker_api.cache_info(self.worker())

    async def context_window(self) -> int | None:
        """The configured window, else the worker's (its model's), asked once each time it
        came up."""
        if self._config.context_window is not None:
            return self._config.context_window
        return await self._window.get(self.worker() if self._up is not False else None,
                                      self._generation)
