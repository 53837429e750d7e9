"""Backend kind `prefixd`: a `prefixd worker` that runs elsewhere (another Mac), reached over
HTTP with its API key. Routed like a managed worker — exact tokenization for prefix reports,
its cache metrics and cache summary, prefix state moves — minus process management: its owner
starts it."""

from __future__ import annotations

from prefixd.backends import worker_api
from prefixd.backends.base import Capabilities, WorkerLink
from prefixd.backends.openai import OpenAIBackend


class RemoteWorkerBackend(OpenAIBackend):
    kind = "prefixd"
    capabilities = Capabilities(moves_state=True, partitions_cache=True)

    def worker(self) -> WorkerLink | None:
        return WorkerLink(self._ensure_session(), self._base, self._auth)

    async def tokenize(self, body: dict) -> list[int] | None:
        return await worker_api.tokenize(self.worker(), body)

    async def metrics_text(self) -> str | None:
        return await worker_api.metrics_text(self.worker())

    async def cache_info(self) -> dict | None:
        return await worker_api.cache_info(self.worker())
