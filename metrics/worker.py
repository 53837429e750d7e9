"""Prompt-cache metrics of the mlx worker (checkpoint store, restores, fallbacks)."""

from prometheus_client import Counter, Gauge, Histogram

from prefixd.metrics import REGISTRY

CACHED_TOKENS = Counter("prefixd_worker_cached_tokens_total",
                        "Prompt tokens restored from the worker's cache (not recomputed).",
                        registry=REGISTRY)
RECOMPUTED_TOKENS = Counter("prefixd_worker_recomputed_tokens_total",
                            "Prompt tokens the worker ran through the model.", registry=REGISTRY)
RESTORE_SECONDS = Histogram("prefixd_worker_restore_seconds",
                            "Time to find and rebuild the cached state for one prompt.",
                            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                     0.5, 1, 2.5), registry=REGISTRY)
PREFILL_SECONDS = Histogram("prefixd_worker_prefill_seconds",
                            "Time to run the not-cached prompt tokens through the model.",
                            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                            registry=REGISTRY)
CACHE_BYTES = Gauge("prefixd_worker_cache_bytes",
                    "Bytes held by the prompt cache, by kind (kv: sequence entries, "
                    "checkpoint: snapshots of non-trimmable layers).", ["kind"], registry=REGISTRY)
CACHE_BUDGET = Gauge("prefixd_worker_cache_budget_bytes",
                     "Byte budget of the prompt cache (PREFIXD_CACHE_BYTES).", registry=REGISTRY)
CACHE_ENTRIES = Gauge("prefixd_worker_cache_entries",
                      "Stored items, by kind (entry, checkpoint).", ["kind"], registry=REGISTRY)
EVICTIONS = Counter("prefixd_worker_cache_evictions_total",
                    "Items dropped to stay within the byte budget, by kind (entry, checkpoint, "
                    "rejected: not stored because it did not fit).", ["kind"], registry=REGISTRY)
FALLBACKS = Counter("prefixd_worker_cache_fallbacks_total",
                    "Requests (or settings) that bypassed the cache, by reason "
                    "(unsupported_cache, restore_error, kv_quant_unsupported).",
                    ["reason"], registry=REGISTRY)
STAGE_SECONDS = Histogram("prefixd_worker_stage_seconds",
                          "Time of each stage of one request in the worker (template, tokenize, "
                          "boundaries, queue, lookup, restore, prefill, checkpoint, "
                          "first_token, commit).", ["stage"],
                          buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                   0.25, 0.5, 1, 2.5, 5, 10, 30, 120), registry=REGISTRY)
GRAMMAR_SECONDS = Histogram("prefixd_worker_grammar_compile_seconds",
                            "Time to compile one constrained reply's grammar (structured output: "
                            "a JSON schema, tool calls) for the model's tokenizer.",
                            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                     0.25, 0.5, 1, 2.5), registry=REGISTRY)
PREFILL_PASSES = Histogram("prefixd_worker_prefill_passes",
                           "Forward passes one prompt prefill took (chunks, cut at checkpoint "
                           "positions).", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128),
                           registry=REGISTRY)
CHECKPOINTS_TAKEN = Counter("prefixd_worker_checkpoints_taken_total",
                            "Checkpoints taken during prefills.", registry=REGISTRY)
CHECKPOINT_TAKEN_BYTES = Counter("prefixd_worker_checkpoint_taken_bytes_total",
                                 "Bytes of the checkpoints taken during prefills.",
                                 registry=REGISTRY)
IMPORTS = Counter("prefixd_worker_cache_imports_total",
                  "Prefix-state bundles posted to /v1/cache/import, by outcome (stored, "
                  "not_stored: the budget did not take it, or the refusal's code: "
                  "no_transfer_secret, unsigned_bundle, bad_mac, too_large, other_model, "
                  "not_a_bundle, damaged, bad_position, bad_tokens, token_out_of_vocabulary, "
                  "wrong_dtype, not_finite, wrong_shape, wrong_structure).", ["outcome"],
                  registry=REGISTRY)

# --- the two tiers (RAM, disk) -------------------------------------------------------------
TIER_HITS = Counter("prefixd_worker_cache_tier_hits_total",
                    "Requests whose cached prefix came from a tier (ram, disk).", ["tier"],
                    registry=REGISTRY)
TIER_BYTES = Gauge("prefixd_worker_cache_tier_bytes",
                   "Bytes held by each tier of the prompt cache (ram, disk).", ["tier"],
                   registry=REGISTRY)
TIER_WRITTEN_BYTES = Counter("prefixd_worker_disk_written_bytes_total",
                             "Bytes written to the disk tier (blocks and records).",
                             registry=REGISTRY)
TIER_READ_BYTES = Counter("prefixd_worker_disk_read_bytes_total",
                          "Bytes read from the disk tier by restores.", registry=REGISTRY)
TIER_LOAD_SECONDS = Histogram("prefixd_worker_cache_tier_load_seconds",
                              "Time to load a cached prefix from a tier (disk).", ["tier"],
                              buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                                       5, 10), registry=REGISTRY)
TIER_SECONDS_SAVED = Counter("prefixd_worker_cache_tier_prefill_seconds_saved_total",
                             "Prefill seconds the restored tokens saved (at the measured "
                             "prefill rate), by tier.", ["tier"], registry=REGISTRY)
TIER_MISSES = Counter("prefixd_worker_cache_misses_total",
                      "Lookups that restored less than the longest prefix the worker knew, "
                      "by reason (evicted, disk_evicted, not_on_disk, write_pending, not_stored, "
                      "load_slower_than_prefill, format_mismatch, corrupt, restore_error).",
                      ["reason"], registry=REGISTRY)

# --- forward passes (batched decode) -------------------------------------------------------
PASS_REQUESTS = Histogram("prefixd_worker_pass_requests",
                          "Requests one forward pass ran, by kind (prefill: one request's "
                          "slice; decode: every request decoding, batched).", ["kind"],
                          buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=REGISTRY)
PASS_TOKENS = Histogram("prefixd_worker_pass_tokens",
                        "Tokens one forward pass ran, by kind (prefill, decode).", ["kind"],
                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
                        registry=REGISTRY)
DRAFT_TOKENS = Counter("prefixd_worker_draft_tokens_total",
                       "Speculative decoding: tokens drafted and verified, and of those the "
                       "tokens accepted, by who drafted them: lookup (the request's own "
                       "context), mtp (the model's multi-token-prediction head), model (a "
                       "draft model).", ["outcome", "source"], registry=REGISTRY)
VERIFY_PASSES = Counter("prefixd_worker_verify_passes_total",
                        "Speculative decoding: forward passes that verified a draft, by how "
                        "they capture the states to go back: none (every layer trims), kept "
                        "(recurrent and window states at each drafted position), recomputed "
                        "(where needed: spec_capture_bytes).",
                        ["states"], registry=REGISTRY)
BATCH_WAIT = Histogram("prefixd_worker_batch_slot_wait_seconds",
                       "Time a request waited for a slot among the requests under way (admission "
                       "by the live caches' memory) before its prefill started.",
                       buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
                       registry=REGISTRY)
