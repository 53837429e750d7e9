"""Build the configured backends, one object per `BackendConfig`, in configuration order."""

from __future__ import annotations

from prefixd.backends.base import Backend
from prefixd.backends.config import BackendConfig
from prefixd.backends.mlx.settings import WorkerSettings
from prefixd.backends.openai import OpenAIBackend
from prefixd.backends.remote import RemoteWorkerBackend


def build_backends(configs: list[BackendConfig], worker: WorkerSettings) -> list[Backend]:
    """`worker`: the settings managed (`mlx`) backends hand to their worker processes."""
    out: list[Backend] = []
    for config in configs:
        if config.kind == "openai":
            out.append(OpenAIBackend(config))
        elif config.kind == "prefixd":
            out.append(RemoteWorkerBackend(config))
        else:
            from prefixd.backends.managed import ManagedBackend

            out.append(ManagedBackend(config, worker))
    return out
