"""The one settings object. Built once (by the CLI or a test) and passed explicitly.

Every option is spelled once, here: its env variable is `PREFIXD_<FIELD>`, its description
is the configuration reference (README and `deploy/prefixd.env.example` are generated from it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

RuleMode = Literal["on", "off", "dry_run"]
DEFAULT_MODEL = "smollm2-135m-instruct"
# Marks the settings a managed worker process needs: the supervisor passes them to its env.
WORKER = {"worker": True}


class BackendConfig(BaseModel):
    """One backend, as an element of the `PREFIXD_BACKENDS` JSON list."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")]
    kind: Literal["openai", "mlx"] = "openai"
    url: str | None = Field(None, description="openai: base URL of the upstream, "
                            "e.g. http://127.0.0.1:8080")
    model: str | None = Field(None, description="mlx: model folder, Hub id, or a built-in name")
    models: list[str] = Field(default_factory=list, description="model names this backend serves")
    max_concurrency: Annotated[int, Field(ge=1)] = 1
    queue_depth: Annotated[int, Field(ge=0)] = 64
    queue_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    request_timeout_s: Annotated[float, Field(gt=0)] = 1800.0
    health_interval_s: Annotated[float, Field(gt=0)] = 10.0
    api_key: SecretStr | None = Field(None, description="openai: bearer token sent upstream")
    # mlx (managed worker) only
    cache_bytes: Annotated[int, Field(ge=0)] | None = None
    startup_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    idle_unload_s: Annotated[float, Field(gt=0)] | None = None
    max_restarts: Annotated[int, Field(ge=0)] = 5
    worker_env: dict[str, str] = Field(default_factory=dict,
                                       description="mlx: extra PREFIXD_* settings for the worker")

    @model_validator(mode="after")
    def _kind_fields(self) -> BackendConfig:
        if self.kind == "openai":
            if not self.url:
                raise ValueError(f"backend {self.name!r}: kind 'openai' needs 'url'")
            if not self.url.startswith(("http://", "https://")):
                raise ValueError(f"backend {self.name!r}: url must start with http(s)://")
            if not self.models:
                raise ValueError(f"backend {self.name!r}: list the model names it serves "
                                 "in 'models'")
        else:
            if not self.model:
                raise ValueError(f"backend {self.name!r}: kind 'mlx' needs 'model'")
            if not self.models:
                self.models = [Path(self.model).name if "/" in self.model else self.model]
        return self


def _unique_names(backends: list[BackendConfig]) -> list[BackendConfig]:
    names = [b.name for b in backends]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"backend names must be unique; repeated: {', '.join(dups)}")
    return backends


class Settings(BaseSettings):
    """prefixd configuration (env prefix `PREFIXD_`; env file `--env-file` or ./prefixd.env)."""

    model_config = SettingsConfigDict(env_prefix="PREFIXD_", env_file="prefixd.env",
                                      env_file_encoding="utf-8", extra="ignore",
                                      validate_default=True)

    # --- server -----------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address the proxy listens on.")
    port: int = Field(8400, ge=1, le=65535, description="Port the proxy listens on.")
    backends: Annotated[list[BackendConfig], AfterValidator(_unique_names)] = Field(
        default_factory=list,
        description="JSON list of backends: {name, kind: openai|mlx, url (openai), model (mlx), "
        "models, max_concurrency, queue_depth, queue_timeout_s, request_timeout_s, ...}. "
        "Empty: one managed mlx backend on `default_model`.")
    default_model: str = Field(DEFAULT_MODEL, description="Model served when no backend is "
                               "configured: a built-in name, a model folder or a Hub id.")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024,
                                description="Largest request body accepted (larger: 413).",
                                json_schema_extra=WORKER)
    api_key: SecretStr | None = Field(None, description="If set, every /v1/* route requires "
                                      "`Authorization: Bearer <api_key>`; /health stays open.")
    log_format: Literal["text", "json"] = Field("text", description="Log line format.",
                                                json_schema_extra=WORKER)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Log level.", json_schema_extra=WORKER)
    shutdown_timeout_s: float = Field(30.0, gt=0, description="On SIGTERM/SIGINT, how long "
                                      "in-flight requests may run before they are cut.")
    cache_dir: Path = Field(Path("~/.cache/prefixd"), description="Where converted models and "
                            "downloaded model packages are kept.", json_schema_extra=WORKER)

    # --- prefix reports and canonicalization (proxy/prefix) -----------------------------
    prefix_detect: bool = Field(True, description="Diff each request against its lane's "
                                "previous one and report prefix mutations.")
    prefix_excerpts: bool = Field(False, description="Keep prompt text excerpts in reports "
                                  "and /debug/prefix (otherwise only hashes and offsets).")
    prefix_history: int = Field(32, ge=1, description="Reports kept per lane at /debug/prefix.")
    lane_idle_s: float = Field(7200.0, gt=0, description="A lane idle this long is forgotten.")
    lane_max: int = Field(256, ge=1, description="Most lanes kept (least recently used go).")
    lane_max_bytes: int = Field(64 * 1024 * 1024, ge=1024,
                                description="Most bytes of lane state kept in memory.")
    canon_strip_billing_header: RuleMode = Field(
        "on", description="R1: strip the `x-anthropic-billing-header:` line from system prompts.")
    canon_pin_tool_order: RuleMode = Field(
        "on", description="R2/R3: send tools in the lane's first-seen order and key order.")
    canon_pin_whitespace: RuleMode = Field(
        "on", description="R5: whitespace-only changes in system/tools keep first-seen bytes.")
    canon_freeze_date: RuleMode = Field(
        "off", description="R6: keep the lane's first date in the system prompt; restate a "
        "new date in the newest user message.")
    canon_relocate_clock_time: RuleMode = Field(
        "off", description="R7: keep the time of day out of the system prompt; state the "
        "exact time in the newest user message.")
    canon_pin_env_block: RuleMode = Field(
        "off", description="R8 (risky): pin <env>-style blocks; restate changes in the "
        "newest user message.")
    canon_keep_trailing_reminder: RuleMode = Field(
        "off", description="R12: re-append a reminder the client dropped from an older user "
        "message (Aider's edit-format rules) so its turns append.")

    # --- mlx worker (backends/mlx) -------------------------------------------------------
    cache_bytes: int = Field(4 * 1024**3, ge=0, description="Worker: byte budget of the "
                             "prompt cache (stored KV + checkpoints); never exceeded.",
                             json_schema_extra=WORKER)
    checkpoint_interval: int | None = Field(
        None, ge=16, description="Worker: also checkpoint every N tokens inside long messages. "
        "Unset: automatic, the smallest power of two from 64 to 4096 whose checkpoints for a "
        "32K-token conversation fit in a quarter of cache_bytes (64 for small models, "
        "thousands for large hybrids).", json_schema_extra=WORKER)
    checkpoint_tail: int = Field(4, ge=0, description="Worker: checkpoint this many tokens "
                                 "before the prompt end (besides the end itself).",
                                 json_schema_extra=WORKER)
    prefill_chunk: int = Field(512, ge=16, description="Worker: prefill this many tokens "
                               "per step.", json_schema_extra=WORKER)
    max_tokens_default: int = Field(1024, ge=1, description="Worker: max_tokens when a "
                                    "request gives none.", json_schema_extra=WORKER)
    kv_bits: int | None = Field(None, description="Worker: quantize the KV cache to this many "
                                "bits (4 or 8); unset keeps full precision.",
                                json_schema_extra=WORKER)
    dequantize: Literal["auto", "on", "off"] = Field(
        "auto", description="Worker: turn quantized weights into float32 after loading. auto: "
        "only built-in models on a CPU-only MLX (4-bit matmuls are slow there).",
        json_schema_extra=WORKER)
    use_system_blas: bool = Field(True, description="Worker (Linux): preload the system "
                                  "OpenBLAS, ~10x faster than MLX's bundled BLAS on CPU.",
                                  json_schema_extra=WORKER)


def redacted(settings: Settings) -> dict:
    """The effective configuration as JSON-able data, secrets replaced by '***'."""
    data = settings.model_dump(mode="json")
    if settings.api_key is not None:
        data["api_key"] = "***"
    for b in data["backends"]:
        if b.get("api_key"):
            b["api_key"] = "***"
    return data


def worker_fields() -> list[str]:
    """Names of the settings a worker process reads (marked `WORKER` above)."""
    return [name for name, f in Settings.model_fields.items()
            if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("worker")]
