"""The configuration of one backend: an element of the `PREFIXD_BACKENDS` JSON list.

Lives in `backends` (the layer that uses it); the proxy's `Settings` holds a list of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, model_validator

from prefixd.backends.mlx.settings import DEFAULT_ACTIVE, Hosts, Parallel


class BackendConfig(BaseModel):
    """One backend, as an element of the `PREFIXD_BACKENDS` JSON list."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")]
    kind: Literal["openai", "mlx", "prefixd", "llama"] = "openai"
    url: str | None = Field(None, description="openai/prefixd: base URL of the upstream, "
                            "e.g. http://127.0.0.1:8080 (prefixd: a `prefixd worker` on "
                            "another machine)")
    model: str | None = Field(None, description="mlx: model folder, Hub id, or a built-in "
                              "name; llama: a GGUF file or a built-in name")
    models: list[str] = Field(default_factory=list, description="model names this backend serves")
    max_concurrency: Annotated[int, Field(ge=1)] | None = Field(
        None, description="requests sent to the backend at once (the rest queue in prefixd). "
        "Default: 1 for openai (one prefill at a time); 64 for mlx and prefixd workers, which "
        "queue and rank every request they get (their scheduler: soonest first token, aging), "
        "admit by memory, batch the decode steps of the admitted ones and interleave their "
        "prefills one forward pass at a time (a managed worker's PREFIXD_MAX_ACTIVE; 1: "
        "serial)")
    queue_depth: Annotated[int, Field(ge=0)] = 64
    queue_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    request_timeout_s: Annotated[float, Field(gt=0)] = 1800.0
    health_interval_s: Annotated[float, Field(gt=0)] = 10.0
    context_window: Annotated[int, Field(ge=2)] | None = Field(
        None, description="the model's context window in tokens (prompt and answer), over "
        "what the backend reports (a llama-server's per-slot n_ctx, a prefixd worker's model "
        "config): a longer prompt is refused in the client API's error shape and max_tokens "
        "is clamped to the room left")
    api_key: SecretStr | None = Field(None, description="openai/prefixd: bearer token sent "
                                      "upstream")
    # mlx (managed worker) only
    cache_bytes: Annotated[int, Field(ge=0)] | None = None
    startup_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    startup_probe_max_s: Annotated[float, Field(gt=0)] = Field(
        0.5, description="mlx/llama: the longest wait between two health probes of a "
        "starting worker (they back off from 50 ms to it)")
    ttl_s: Annotated[float, Field(gt=0)] | None = Field(
        None, validation_alias=AliasChoices("ttl_s", "idle_unload_s"),
        description="mlx: unload the worker after this many idle seconds (also accepted as "
        "idle_unload_s)")
    pin: bool = Field(False, description="mlx: never unloaded to make room for another model")
    group: str | None = Field(None, description="mlx: models of one group are never loaded "
                              "together")
    max_restarts: Annotated[int, Field(ge=0)] = Field(
        5, description="mlx: failed starts in a row (the worker never became ready) before "
        "the backend is `failed`; crashes of a worker that was ready are always restarted")
    retry_failed_s: Annotated[float, Field(gt=0)] = Field(
        60.0, description="mlx: a `failed` backend tries one new start this often (and "
        "when a request needs it)")
    hosts: Hosts = Field(
        default_factory=list, description="mlx: run the worker as a group of ranks on MLX's "
        "distributed runtime, one per host (this machine first; loopback entries run here, "
        "others over ssh: docs/DISTRIBUTED.md), e.g. [\"127.0.0.1\", \"10.0.0.2\"]; "
        "supervised as one unit. Unset: PREFIXD_GROUP_HOSTS")
    parallel: Parallel = Field(
        "auto", description="mlx (with hosts): how the model is split across them. Unset: "
        "PREFIXD_PARALLEL")
    kv_events: str | None = Field(
        None, description="the backend's KV event stream in vLLM's format (ZMQ), which the "
        "router follows to learn what it holds: mlx, the endpoint its worker publishes on "
        "(e.g. tcp://127.0.0.1:5557, bound by the worker); openai/prefixd, the endpoint a "
        "remote server (a prefixd worker, vLLM, SGLang) publishes on (docs/KV_EVENTS.md)")
    kv_events_replay: str | None = Field(
        None, description="the stream's replay endpoint (vLLM's ZMQ ROUTER), asked for "
        "batches a gap lost; mlx: its worker binds it")
    kv_events_topic: str = Field("", description="the topic prefix to subscribe to (all: "
                                 "empty)")
    slots: Annotated[int, Field(ge=1, le=256)] | None = Field(
        None, description="llama: the server's slots (-np), one conversation's prompt each; "
        "default 4. Its context is slots x context_window (default 8192 per slot)")
    llama_args: list[str] = Field(
        default_factory=list, description="llama: extra llama-server flags, after prefixd's "
        "own (a flag given here wins), e.g. [\"-t\", \"8\", \"-ngl\", \"99\"]")
    worker_env: dict[str, str] = Field(default_factory=dict,
                                       description="mlx: extra PREFIXD_* settings for the worker")

    @property
    def concurrency(self) -> int:
        """`max_concurrency`, or its default for the kind."""
        if self.max_concurrency is not None:
            return self.max_concurrency
        if self.kind == "llama":          # a request per slot; more would wait in the server
            return self.slots or 4
        return 1 if self.kind == "openai" else DEFAULT_ACTIVE

    @model_validator(mode="after")
    def _kind_fields(self) -> BackendConfig:
        if self.kind in ("openai", "prefixd"):
            if not self.url:
                raise ValueError(f"backend {self.name!r}: kind {self.kind!r} needs 'url'")
            if not self.url.startswith(("http://", "https://")):
                raise ValueError(f"backend {self.name!r}: url must start with http(s)://")
            if not self.models:
                raise ValueError(f"backend {self.name!r}: list the model names it serves "
                                 "in 'models'")
        else:
            if not self.model:
                raise ValueError(f"backend {self.name!r}: kind {self.kind!r} needs 'model'")
            if not self.models:
                name = Path(self.model).name if "/" in self.model else self.model
                self.models = [name.removesuffix(".gguf")]
        return self


def with_group(config: BackendConfig, hosts: list[str], parallel: Parallel) -> BackendConfig:
    """The one place a managed backend's group is decided: its own `hosts` and `parallel`, else
    the worker settings' (`PREFIXD_GROUP_HOSTS`, `PREFIXD_PARALLEL`, e.g. from the env file).
    Everything after reads `config.hosts` and `config.parallel` only."""
    if config.kind != "mlx":
        return config
    update: dict[str, object] = {}
    if not config.hosts and hosts:
        update["hosts"] = list(hosts)
    if "parallel" not in config.model_fields_set:
        update["parallel"] = parallel
    return config.model_copy(update=update) if update else config


def redact_url(url: str) -> str:
    """`url` with the password of its userinfo replaced by '***' (`http://user:***@host`); a
    username alone may be a token (`https://TOKEN@host`), so it becomes '***' too."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.username is None and parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = f"{parts.username}:***" if parts.password is not None else "***"
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))
