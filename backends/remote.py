"""Backend kind `prefixd`: a `prefixd worker` that runs elsewhere (another Mac), reached over
HTTP with its API key. Routed like a managed worker — exact tokenization for prefix reports,
its cache metrics and cache summary — minus process management: its owner starts it."""

from __future__ import annotations

from prefixd.backends.openai import OpenAIBackend
from prefixd.backends.worker_api import Endpoint, WorkerEndpoints


class RemoteWorkerBackend(WorkerEndpoints, OpenAIBackend):
    kind = "prefixd"

    def _endpoint(self) -> Endpoint | None:
        return self._ensure_session(), self._base, self._auth
