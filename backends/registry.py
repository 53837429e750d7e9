"""Build the configured backends, one object per `BackendConfig`, in configuration order."""

from __future__ import annotations

from prefixd.backends.base import Backend
from prefixd.backends.openai import OpenAIBackend
from prefixd.proxy.settings import Settings


def build_backends(settings: Settings) -> list[Backend]:
    out: list[Backend] = []
    for config in settings.backends:
        if config.kind == "openai":
            out.append(OpenAIBackend(config))
        else:
            from prefixd.backends.managed import ManagedBackend

            out.append(ManagedBackend(config, settings))
    return out
