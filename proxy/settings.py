"""The one settings object. Built once (by the CLI or a test) and passed explicitly.

Every option is spelled once: its env variable is `PREFIXD_<FIELD>`, its description is the
configuration reference (docs/CONFIGURATION.md and `deploy/prefixd.env.example` are generated
from it). The worker's own settings (`WorkerSettings`, in the worker's package) are inherited,
so the proxy's env file configures its workers too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, Field, SecretStr, create_model, model_validator

from prefixd.backends.config import BackendConfig, redact_url, with_group
from prefixd.backends.mlx.settings import DEFAULT_MODEL, WorkerSettings
from prefixd.proxy.prefix.rules import RULES, RuleMode
from prefixd.proxy.routing.policy import Balance

__all__ = ["DEFAULT_MODEL", "BackendConfig", "RuleMode", "Settings", "redacted"]


def _unique_names(backends: list[BackendConfig]) -> list[BackendConfig]:
    names = [b.name for b in backends]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"backend names must be unique; repeated: {', '.join(dups)}")
    return backends


class DeclaredSettings(WorkerSettings):
    """prefixd configuration (env prefix `PREFIXD_`; env file `--env-file` or ./prefixd.env)."""

    # --- server -----------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address the proxy listens on.")
    port: int = Field(8400, ge=1, le=65535, description="Port the proxy listens on.")
    backends: Annotated[list[BackendConfig], AfterValidator(_unique_names)] = Field(
        default_factory=list,
        description="JSON list of backends: {name, kind: openai|mlx|llama|prefixd, url (openai), "
        "model (mlx: folder or built-in; llama: GGUF file or built-in), "
        "models, max_concurrency, queue_depth, queue_timeout_s, request_timeout_s, ...}. "
        "Empty: one managed mlx backend on `default_model`.")
    llama_server: str | None = Field(
        None, description="The llama-server binary that `llama` backends run. Unset: "
        "`llama-server` on PATH, else the one bench/build_llama_server.sh builds under "
        "cache_dir (docs/LLAMA.md).")
    api_key: SecretStr | None = Field(None, description="If set, /v1/*, /status, /metrics and "
                                      "/debug/* require `Authorization: Bearer <api_key>` (or "
                                      "`x-api-key`); /health, /ready and the status page "
                                      "(/, /ui/*) stay open.")
    cache_isolation: Literal["shared", "per_key"] = Field(
        "shared", description="`shared`: one prompt cache for every client (a single-user "
        "daemon). That is a side channel between clients: `cached_tokens` (and the time to "
        "first token) tell a client whether a prefix it guesses, say another client's system "
        "prompt, is cached. `per_key`: cache entries, conversations (lanes) and routing "
        "predictions are shared only between requests made with the same API key (the "
        "`Authorization: Bearer`/`x-api-key` value the client presents; any string when "
        "`api_key` is unset), in prefixd workers' caches (managed and kind `prefixd`; their "
        "per-key entries stay in RAM: the disk tier keeps the shared cache only); an "
        "`openai` backend's own cache (llama-server, vLLM) cannot be partitioned, and a "
        "warning at start says so. The operator views follow: a key sees only its own lanes "
        "on /status, /debug/prefix and the status page, and /metrics needs `operator_key`.")
    operator_key: SecretStr | None = Field(
        None, description="The operator's key (accepted wherever `api_key` is). Under "
        "`per_key` isolation a caller sees only its own key's lanes on /status, /debug/prefix "
        "and the status page (another key's lane is a 404), and /metrics (every key's "
        "traffic) answers only this key (403 otherwise); with it, every lane and /metrics. "
        "Unused under `shared`, where every admitted caller sees everything.")
    lane_secret: SecretStr | None = Field(
        None, min_length=16, description="The key of the digests in lane ids (HMAC-SHA256 of "
        "the client, model and first user message, and of the key's namespace), so an id "
        "shown on a view cannot confirm a guessed message. Unset: random per run. Give "
        "prefixd replicas behind one load balancer the same value if they must agree on lane "
        "ids (routing uses a lane id only for a request without a prefix chain; at least 16 "
        "characters).")
    max_connections: int = Field(512, ge=1, description="Most client connections open at "
                                 "once; more are closed at once (the proxy also raises its "
                                 "open-files limit at start).")
    model_memory_bytes: int | None = Field(
        None, ge=0, description="Memory the managed (mlx) models may use together: weights + "
        "cache budget + process overhead each (estimated, then measured by each worker once "
        "loaded). A model that does not fit unloads the least recently used idle ones first; "
        "busy or pinned ones are never unloaded. Models without a cache budget (no "
        "`cache_bytes`, no PREFIXD_CACHE_BYTES) get a share of it. Unset: 75% of physical "
        "memory.")
    model_aliases: dict[str, str] = Field(
        default_factory=dict, description="JSON object of model-name patterns (shell-style "
        "wildcards, first match wins) -> a served model, for clients that send their own "
        "vendor's names: {\"claude-*haiku*\": \"small\", \"claude-*\": \"coder\", "
        "\"gpt-*\": \"coder\"}.")
    shutdown_timeout_s: float = Field(30.0, gt=0, description="On SIGTERM/SIGINT, how long "
                                      "in-flight requests may run before they are cut.")
    # --- routing across backends (proxy/routing) ---------------------------------------
    route_balance_slack: int = Field(
        Balance.slack, ge=0,
        description="Affinity (a backend holding the conversation's prefix) yields to load "
        "only when that backend's queued + in-flight requests exceed the least loaded "
        "backend's by more than this many per slot, and by more than `route_balance_ratio` "
        "times.")
    route_balance_ratio: float = Field(
        Balance.ratio, ge=1.0,
        description="The relative half of that test: affinity yields only when the chosen "
        "backend has more than this many times the least loaded backend's requests (counted "
        "as at least 1).")
    route_min_hit_tokens: int = Field(
        Balance.min_hit_tokens, ge=0,
        description="An indexed prefix shorter than this many tokens does not draw a request "
        "to the backend holding it (not worth a longer wait).")
    route_transfer_min_tokens: int = Field(
        256, ge=0,
        description="Before a prefixd worker (managed or kind `prefixd`) serves a request, "
        "copy the request's prefix state from another worker of the same model that holds or "
        "is computing at least this many more of its tokens, instead of recomputing them "
        "(0: never). Also the least a backend running several requests at once must be "
        "computing of a request's prefix for the request to wait for it "
        "(`route_prefix_wait_s`; 256 when this is 0).")
    route_transfer_timeout_s: float = Field(
        10.0, gt=0,
        description="How long a request waits for that copy, the source finishing its "
        "request in progress included; after that it is served without it.")
    route_prefix_wait_s: float = Field(
        30.0, ge=0,
        description="A request for a llama-server with several slots that is computing at "
        "least `route_transfer_min_tokens` tokens of the request's prefix it does not hold "
        "yet (a burst of sub-agents with one system prompt) waits at most this long for that "
        "request to end, then restores the prefix from the backend's cache instead of "
        "computing it again beside it (0: never wait). A prefixd worker does this itself for "
        "every request it holds, only until the shared prefix is computed.")
    route_index_entries: int = Field(
        100_000, ge=100,
        description="Prefix boundaries the routing index keeps per backend (least recently "
        "used dropped first; ~250 bytes each: 100000 is ~25 MB per backend).")
    route_index_ttl_s: float = Field(
        7200.0, gt=0, description="A prefix the routing index has not seen for this long is "
        "dropped (backends evict too).")
    # --- the gateway's endpoint picker (`prefixd picker`, proxy/picker) -----------------
    picker_port: int = Field(9002, ge=1, le=65535, description="`prefixd picker`: the port "
                             "of its Envoy ext_proc gRPC service and gRPC health (on host).")
    picker_endpoints_file: Path | None = Field(
        None, description="`prefixd picker`: a JSON file of endpoints ({\"endpoints\": "
        "[{\"address\": \"ip:port\", \"models\": [...], \"max_concurrency\": 1}]}), re-read "
        "when it changes; beside the backends with a url (docs/GATEWAY.md).")
    picker_metrics_port: int | None = Field(
        None, ge=1, le=65535, description="`prefixd picker`: serve Prometheus metrics "
        "(/metrics) on this port (on host); unset: none.")
    picker_probe_s: float = Field(2.0, gt=0, description="`prefixd picker`: seconds between "
                                  "two probes of each endpoint's /v1/models (health, models) "
                                  "and two reads of the endpoints file.")
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
    # canon_<rule>: one field per canonicalization rule, generated below from its entry in
    # proxy/prefix/rules.py (name, default, description), after the fields above.

    @model_validator(mode="after")
    def _backend_groups(self) -> DeclaredSettings:
        """Each managed backend's group settled here, once (`with_group`)."""
        self.backends = [with_group(b, self.group_hosts, self.parallel) for b in self.backends]
        return self

    def rule_modes(self) -> dict[str, RuleMode]:
        """Each canonicalization rule's mode (its `canon_<rule>` field), by rule name."""
        return {r.name: getattr(self, r.setting) for r in RULES}


if TYPE_CHECKING:       # the type checker reads the fields declared above; nothing reads the
    Settings = DeclaredSettings          # generated ones but `rule_modes` (by name)
else:
    Settings = create_model(
        "Settings", __base__=DeclaredSettings, __module__=__name__,
        __doc__=DeclaredSettings.__doc__,
        **{r.setting: (RuleMode, Field(r.default, description=r.doc)) for r in RULES})


def redacted(settings: Settings) -> dict:
    """The configuration as JSON-able data, secrets replaced by '***': API keys, the
    userinfo password of every URL (`http://user:***@host`), every `worker_env` value
    (they carry tokens)."""
    data = _redact_urls(settings.model_dump(mode="json"))
    for secret in ("api_key", "operator_key", "lane_secret"):
        if getattr(settings, secret) is not None:
            data[secret] = "***"
    for b in data["backends"]:
        if b.get("api_key"):
            b["api_key"] = "***"
        b["worker_env"] = dict.fromkeys(b.get("worker_env") or {}, "***")
    return data


def _redact_urls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _redact_urls(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_urls(v) for v in value]
    return redact_url(value) if isinstance(value, str) and "://" in value else value
