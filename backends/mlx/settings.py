"""The worker's settings: what a `prefixd worker` process reads from its environment
(`PREFIXD_*`). The proxy's `Settings` extends this class, so one env file configures both and
the supervisor hands exactly these fields to the workers it starts. Imports no mlx.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, SecretStr
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# Requests a worker holds under way at most by default (a managed backend's default
# max_concurrency): every request the proxy would queue (its default queue_depth), so the
# worker's scheduler ranks all of them; what it admits of them is bounded by memory
# (active_kv_share of the cache budget: the live caches, `scheduler/policy/room.py`).
DEFAULT_ACTIVE = 64
# How a group worker splits its model (`loading.distribute`).
Parallel = Literal["auto", "pipeline", "tensor"]

DEFAULT_MODEL = "smollm2-135m-instruct"


def host_list(value: object) -> object:
    """A group's hosts as people write them in an env file or a backend: a JSON list
    (`["10.0.0.1", "10.0.0.2"]`) or comma-separated (`10.0.0.1,10.0.0.2`)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        return json.loads(text)         # a ValueError: the setting's validation error
    return [h.strip() for h in text.split(",") if h.strip()]


# A group's hosts (`group_hosts`, a backend's `hosts`): JSON or comma-separated.
Hosts = Annotated[list[str], BeforeValidator(host_list)]


class WorkerSettings(BaseSettings):
    """Settings of an mlx worker process (env prefix `PREFIXD_`)."""

    model_config = SettingsConfigDict(env_prefix="PREFIXD_", env_file="prefixd.env",
                                      env_file_encoding="utf-8", extra="ignore",
                                      validate_default=True)

    default_model: str = Field(DEFAULT_MODEL, description="Model served when no backend is "
                               "configured: a built-in name, a model folder or a Hub id.")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024,
                                description="Largest request body accepted (larger: 413).")
    header_timeout_s: float = Field(
        10.0, gt=0, description="A request's headers must arrive within this many seconds (a "
        "new connection's first request from its opening, a later one from its first byte), "
        "else the connection is closed: the proxy's and a worker's.")
    body_timeout_s: float = Field(
        60.0, gt=0, description="A request body must arrive within this many seconds, else "
        "408 and the connection is closed: the proxy's routes and a worker's (a prefix-state "
        "import included), so a client trickling its body holds no connection longer.")
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Log level.")
    cache_dir: Path = Field(Path("~/.cache/prefixd"), description="Where converted models, "
                            "downloaded model packages and the prompt cache's disk tier "
                            "(prompts/<cache key>/) are kept.")

    cache_bytes: int | None = Field(None, ge=0, description="Worker: byte budget of the "
                                    "prompt cache in RAM (stored KV + checkpoints); never "
                                    "exceeded. Unset: half of the memory available once the "
                                    "model is loaded, less 2 GiB (at least 256 MiB).")
    disk_cache_bytes: int | None = Field(
        None, ge=0, description="Worker: byte budget of the prompt cache's disk tier (0: no "
        "disk tier). Unset: a quarter of the free space under cache_dir, at most 32 GiB.")
    disk_write_delay: float = Field(
        2.0, ge=0, description="Worker: seconds a conversation must be idle before its newest "
        "state is written to disk (states a newer turn supersedes sooner are never written; "
        "states evicted from RAM, and everything at shutdown, are written at once).")
    disk_block_tokens: int = Field(256, ge=16, description="Worker: tokens per shared KV "
                                   "block on disk (a block is written once, whatever shares "
                                   "its prefix).")
    checkpoint_interval: int | None = Field(
        None, ge=16, description="Worker: also checkpoint every N tokens inside long messages. "
        "Unset: automatic, the smallest power of two from 64 to 4096 whose checkpoints for a "
        "32K-token conversation fit in a quarter of cache_bytes (64 for small models, "
        "thousands for large hybrids).")
    checkpoint_interval_policy: Literal["bytes", "cost"] = Field(
        "bytes", description="Worker: how the automatic interval is sized. bytes: by the "
        "checkpoints' size alone (a mid-message edit recomputes at most ~one interval). cost: "
        "also so that extra prefill passes cost at most 2% of the prefill; matters only for "
        "models without in-pass checkpoints (checkpoint_inpass), where each checkpoint inside "
        "a pass cuts it in two.")
    checkpoint_inpass: bool = Field(
        True, description="Worker: take checkpoints inside a prefill pass from the states the "
        "pass computes (recurrences split there, sliding windows sliced), so they cost no "
        "extra forward pass. Used only for models whose in-pass checkpoints match cut passes "
        "at start-up (Gated-DeltaNet, Mamba2 and sliding-window layers of mlx-lm 0.32); "
        "false: always cut the pass.")
    checkpoint_tail: int = Field(4, ge=0, description="Worker: checkpoint this many tokens "
                                 "before the prompt end (besides the end itself).")
    prefill_chunk: int = Field(512, ge=16, description="Worker: prefill this many tokens "
                               "per step.")
    max_active: int = Field(DEFAULT_ACTIVE, ge=1, description="Worker: jobs under way at "
                            "most (a managed worker: its backend's max_concurrency); how many "
                            "are admitted is bounded by memory (active_kv_share), the rest "
                            "wait in the worker's queue, told their place. More than 1: the "
                            "worker interleaves them one forward pass at a time (a prefill "
                            "slice, or one decode step of every request decoding: batched), "
                            "so a short request does not wait behind a long prefill "
                            "(docs/CHECKPOINTS.md, Scheduling). 1: one job at a time, to its "
                            "end, in arrival order.")
    batch_decode: bool = Field(True, description="Worker (max_active > 1): the decode steps "
                               "of every request under way share one forward pass (mlx-lm's "
                               "batch caches; a model whose caches cannot merge, e.g. with "
                               "kv_bits, decodes one request per pass). false: one request's "
                               "step per pass.")
    decode_ahead: Literal["auto", "on", "off"] = Field(
        "auto", description="Worker (batch_decode): a batch of greedy requests launches its "
        "next decode pass as soon as this one's tokens are read, so their Python work between "
        "two passes (detokenizing, stop strings, events) overlaps the next pass; a change to the "
        "batch (a request ends or joins, a draft is verified) takes that pass back, its "
        "compute lost. auto: while the time it saves beats the passes it loses (measured on "
        "2 CPU cores: 16 requests on a tiny hybrid +8%; 4 on the built-in 135M model, no "
        "difference: its passes keep the cores busy); on: always; off: never. Exact either "
        "way (greedy replies as without it).")
    speculative: bool = Field(True, description="Worker: speculative decoding with drafts "
                              "looked up in the request's own context (prompt lookup): a "
                              "reply that copies (an edit, a file rewritten, a path or JSON "
                              "echoed from a tool result) decodes several tokens per forward "
                              "pass; exact (greedy replies equal decoding without it, sampled "
                              "ones follow the same distribution, seeded ones draw with the "
                              "same keys: the same tokens up to rounding), on every cache "
                              "type including recurrent and sliding-"
                              "window layers, alone, in decode batches and under structured "
                              "output. Each request drafts only while its drafts pay, and a "
                              "decode batch only while its verify passes beat its plain steps "
                              "(docs/CHECKPOINTS.md, Speculative decoding).")
    spec_draft_max: int | None = Field(
        None, ge=1, le=64, description="Worker: the longest draft verified in one pass (each "
        "request sizes its drafts from their acceptance, up to this). Unset: 16 on models whose "
        "layers all trim (full attention), 8 where recurrent or sliding-window state is "
        "captured at each position of a verify pass (held until the next pass, or computed "
        "again: spec_capture_bytes).")
    spec_draft_model: str | None = Field(
        None, description="Worker: a smaller model with the served model's tokenizer (a path "
        "or a name, as default_model) that drafts where the context has nothing to copy; any "
        "cache kind (a hybrid's goes back from its state where its last draft began: a small "
        "Qwen3.5 for a large one); not in a group. Checked at load: every token id naming the "
        "same token as the served model's tokenizer, the same end-of-sequence ids, every "
        "weight finite; one that fails (or does not load) is not used, named with why in the "
        "log and in /v1/cache (speculative.refused). Unset: prompt lookup alone.")
    spec_mtp: bool = Field(
        True, description="Worker: draft with the model's own multi-token-prediction head "
        "where its checkpoint carries one (Qwen3-Next, Qwen3.5: `mtp.*` weights in the model "
        "folder's safetensors, which mlx-lm drops; beside an mlx conversion, put them in "
        "mtp.safetensors), where the context has nothing to copy, before spec_draft_model. "
        "Float or quantized in mlx's layout (weight, scales, biases; bits and group size from "
        "config.json's quantization, else as the shapes imply). A head that does not fit the "
        "model, cannot load or whose weights are not all finite is not used (logged, "
        "/v1/cache speculative.refused). In a group: pipeline-parallel only, every rank "
        "holding it.")
    spec_capture_bytes: int = Field(
        64 * 2**20, ge=0, description="Worker: the most bytes of recurrent state (Gated-"
        "DeltaNet, Mamba) a verify pass keeps, for all its requests, one per drafted position "
        "(to go back exactly to the last accepted token; held until each request's next pass). "
        "Above it, the state at the accepted position is computed again from the pass's own "
        "inputs (the same calls: exact), for the requests that need it: a large hybrid's "
        "speculation holds about one extra state per request instead of one per drafted "
        "token, for a little time per verify pass. 0: always compute again.")
    spec_ngram: int = Field(2, ge=1, le=16, description="Worker: the fewest tokens a "
                            "match in the context must have to draft from (the reply's last "
                            "tokens looked up; their earlier occurrences vote on the "
                            "continuation, each weighted by how far back its match reaches).")
    prefill_slice_ms: float = Field(
        250.0, ge=0, description="Worker (max_active > 1): prefill in passes of about this "
        "many milliseconds, sized from the job's own last pass (its rate at its depth; at "
        "least 32 tokens, at most prefill_chunk). A short request arriving during a long "
        "prefill waits only for the layer under way (the pass pauses for it); other jobs' "
        "decode steps wait at most about one such pass. 0: slices of prefill_slice tokens "
        "while other jobs wait, whole prefill_chunk passes alone.")
    prefill_slice: int = Field(256, ge=16, description="Worker (max_active > 1): the slice in "
                               "tokens until a prefill rate is measured (or always, with "
                               "prefill_slice_ms 0).")
    active_kv_share: float = Field(
        0.5, gt=0, description="Worker (max_active > 1): admission by memory: the live KV "
        "caches of the admitted jobs within this share of cache_bytes (each job counted at "
        "its prompt tokens + max_tokens x the model's KV bytes per token); a short job is "
        "admitted beside a long answer on the room it leaves now, the long one pausing while "
        "it would take that room back; a decode batch takes only the rows whose copy padded "
        "to the longest fits; a job that does not fit waits (one job alone always runs; "
        "docs/CHECKPOINTS.md, Admission by memory).")
    group_hosts: Annotated[Hosts, NoDecode] = Field(
        default_factory=list, description="Worker: run as a group of this many ranks on MLX's "
        "distributed runtime (ring backend), one per host, this process (rank 0) on the first: "
        "e.g. 127.0.0.1,127.0.0.1 or [\"10.0.0.1\", \"10.0.0.2\"] (comma-separated or JSON; "
        "other hosts over ssh, the same interpreter path; docs/DISTRIBUTED.md). Empty or one: "
        "one process. In the proxy's env file: the hosts of every managed mlx backend that "
        "names no `hosts` of its own.")
    parallel: Parallel = Field(
        "auto", description="Worker (group): how the model is split: pipeline (consecutive "
        "layers per rank), tensor (every layer's heads), auto (pipeline where mlx-lm has it). In "
        "the proxy's env file: the split of every managed mlx backend that names none.")
    group_watchdog_s: float = Field(
        10.0, ge=1.0, description="Worker (group): a rank the leader has not heard from for this "
        "long (its heartbeats come every watchdog/5 s, or 1 s, from their own thread: a long "
        "pass does not delay them; a stopped or hung process sends none) ends the group, which "
        "the supervisor restarts, sending the requests in flight again.")
    max_tokens_default: int = Field(1024, ge=1, description="Worker: max_tokens when a "
                                    "request gives none.")
    kv_bits: int | None = Field(None, description="Worker: quantize the KV cache to this many "
                                "bits (4 or 8); unset keeps full precision.")
    dequantize: Literal["auto", "on", "off"] = Field(
        "auto", description="Worker: turn quantized weights into float32 after loading. auto: "
        "only built-in models on a CPU-only MLX (4-bit matmuls are slow there).")
    use_system_blas: bool = Field(True, description="Worker (Linux): preload the system "
                                  "OpenBLAS, ~10x faster than MLX's bundled BLAS on CPU.")
    transfer_secret: SecretStr | None = Field(
        None, min_length=16, description="Worker: the secret that signs and checks prefix-state "
        "bundles moved between workers (HMAC-SHA256); a worker imports only bundles signed with "
        "its own, and none without one. The proxy gives the workers it starts this value, or "
        "one it generates per run when unset; give a remote `prefixd worker` the value of the "
        "workers it exchanges states with (at least 16 characters).")
    kv_events: str | None = Field(
        None, description="Worker: publish KV events in vLLM's format on this ZMQ endpoint "
        "(e.g. tcp://*:5557): blocks as they become restorable, in RAM (medium GPU) and on "
        "disk (DISK), removed when they stop being; on hybrid models only where a "
        "checkpoint restores the whole state (docs/KV_EVENTS.md). Bound when its host is *, "
        "this machine's or ipc://, else connected to. A managed backend's `kv_events` sets "
        "it. Unset: no events.")
    kv_events_replay: str | None = Field(
        None, description="Worker: the replay endpoint (ZMQ ROUTER, bound) of the KV event "
        "stream, e.g. tcp://*:5558: a subscriber that missed batches asks for them from a "
        "sequence number (vLLM's replay). Unset: no replay.")
    kv_events_topic: str | None = Field(
        None, description="Worker: the KV event stream's topic. Unset: "
        "`kv@<host>:<port>@<served model>`, the form llm-d reads the pod and model from.")
    kv_events_encoding: Literal["map", "array"] = Field(
        "map", description="Worker: how KV events are encoded: maps with a `type` key, what "
        "vLLM emits since 2026-06 (PR #42892), or the positional arrays of vLLM before it.")
    kv_events_buffer: int = Field(10_000, ge=1, description="Worker: KV event batches kept "
                                  "for replay.")


def worker_fields() -> list[str]:
    """Names of the settings a worker process reads."""
    return list(WorkerSettings.model_fields)
