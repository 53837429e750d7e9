"""Build the configured backends, one object per `BackendConfig`, in configuration order."""

from __future__ import annotations

from prefixd.backends.base import Backend
from prefixd.backends.config import BackendConfig
from prefixd.backends.mlx.settings import WorkerSettings
from prefixd.backends.openai import OpenAIBackend
from prefixd.backends.remote import RemoteWorkerBackend


def build_backends(configs: list[BackendConfig], worker: WorkerSettings) -> list[Backend]:
    """`worker`: the settings managed (`mlx`) backends hand to their worker processes (the
    proxy's settings: `llama_server` is read from them for kind `llama`)."""
    out: list[Backend] = []
    for config in configs:
        if config.kind == "openai":
            out.append(OpenAIBackend(config))
        elif config.kind == "prefixd":
            out.append(RemoteWorkerBackend(config))
        elif config.kind == "llama":
            from prefixd.backends.llama.managed import LlamaBackend

            out.append(LlamaBackend(config, worker, getattr(worker, "llama_server", None)))
        else:
            from prefixd.backends.managed import ManagedBackend

            out.append(ManagedBackend(config, worker))
    return out
