"""Request, queue and backend metrics of the proxy."""

from prometheus_client import Counter, Gauge, Histogram

from prefixd.metrics import REGISTRY

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

REQUESTS = Counter("prefixd_requests_total",
                   "Requests answered, by backend, model and HTTP status.",
                   ["backend", "model", "status"], registry=REGISTRY)
REQUEST_DURATION = Histogram("prefixd_request_duration_seconds",
                             "Time from request arrival to the last byte sent.",
                             ["backend", "model"], buckets=_LAT, registry=REGISTRY)
QUEUE_WAIT = Histogram("prefixd_queue_wait_seconds",
                       "Time a request waited for its backend slot.",
                       ["backend"], buckets=(0.001, *_LAT), registry=REGISTRY)
WAITED = Histogram("prefixd_waited_behind_seconds",
                   "Time a request spent waiting behind other requests: in prefixd's queue, "
                   "then in a prefixd worker's (waiting to start, paused while others' "
                   "forward passes ran).", ["backend"], buckets=(0.001, *_LAT),
                   registry=REGISTRY)
TTFT = Histogram("prefixd_time_to_first_token_seconds",
                 "Time from request arrival to the first streamed content chunk.",
                 ["backend", "model"], buckets=_LAT, registry=REGISTRY)
GRAMMAR_CHECK = Histogram("prefixd_grammar_check_seconds",
                          "Time to compile a request's JSON schemas (response format, tool "
                          "parameters) before it is queued; a schema that does not compile "
                          "is a 400 then.", buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                                     0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                          registry=REGISTRY)
QUEUE_DEPTH = Gauge("prefixd_queue_depth", "Requests waiting for a backend slot.", ["backend"],
                    registry=REGISTRY)
IN_FLIGHT = Gauge("prefixd_in_flight", "Requests being served by a backend.", ["backend"],
                  registry=REGISTRY)
QUEUE_REJECTED = Counter("prefixd_queue_rejected_total",
                         "Requests refused by a queue, by reason "
                         "(full, timeout, disconnect, shutdown).",
                         ["backend", "reason"], registry=REGISTRY)
BACKEND_UP = Gauge("prefixd_backend_up", "1 if the backend answered its last health check.",
                   ["backend"], registry=REGISTRY)
BACKEND_STATE = Gauge("prefixd_backend_state",
                      "Managed backend process state (1 for the current state).",
                      ["backend", "state"], registry=REGISTRY)
UPSTREAM_RESENDS = Counter("prefixd_upstream_resends_total",
                           "Requests sent again on a new connection: the upstream had closed "
                           "the pooled keep-alive connection they went out on before answering.",
                           ["backend"], registry=REGISTRY)
BACKEND_RESTARTS = Counter("prefixd_backend_restarts_total",
                           "Managed worker restarts after a crash.", ["backend"], registry=REGISTRY)
PROMPT_TOKENS = Counter("prefixd_prompt_tokens_total", "Prompt tokens reported by backends.",
                        ["backend", "model"], registry=REGISTRY)
CACHED_TOKENS = Counter("prefixd_cached_prompt_tokens_total",
                        "Prompt tokens the backend served from its cache "
                        "(usage.prompt_tokens_details.cached_tokens).",
                        ["backend", "model"], registry=REGISTRY)
COMPLETION_TOKENS = Counter("prefixd_completion_tokens_total",
                            "Completion tokens reported by backends.", ["backend", "model"],
                            registry=REGISTRY)
ROUTE_DECISIONS = Counter("prefixd_route_decisions_total",
                          "Routing decisions by backend and reason (affinity, index_hit, balance, "
                          "failover, new).", ["backend", "reason"], registry=REGISTRY)
ROUTE_PREDICTED_TOKENS = Counter("prefixd_route_predicted_cached_tokens_total",
                                 "Cached prompt tokens the prefix index predicted.",
                                 ["backend"], registry=REGISTRY)
ROUTE_MISPREDICTIONS = Counter("prefixd_route_mispredictions_total",
                               "Requests whose backend reported fewer cached tokens than "
                               "predicted (its index entries beyond that were dropped).",
                               ["backend"], registry=REGISTRY)
TRANSFERS = Counter("prefixd_route_transfers_total",
                    "Prefix states copied from one worker to another before a request, by "
                    "outcome (moved, not_cached, refused, timeout, error).",
                    ["source", "target", "outcome"], registry=REGISTRY)
TRANSFER_TOKENS = Counter("prefixd_route_transfer_tokens_total",
                          "Prompt tokens of prefix state copied into a worker instead of "
                          "recomputed there.", ["target"], registry=REGISTRY)
TRANSFER_BYTES = Counter("prefixd_route_transfer_bytes_total",
                         "Bytes of prefix state streamed between workers.", ["target"],
                         registry=REGISTRY)
TRANSFER_SECONDS = Histogram("prefixd_route_transfer_seconds",
                             "Time a request waited for a prefix state to be copied in (the "
                             "source finishing its request in progress included).",
                             ["target"], buckets=_LAT, registry=REGISTRY)
PREFIX_WAITS = Counter("prefixd_route_prefix_waits_total",
                       "Requests that waited for a llama-server to finish computing a long "
                       "prefix they share, to restore it from its RAM prompt cache, by outcome "
                       "(done, timeout).", ["backend", "outcome"], registry=REGISTRY)
INDEX_ENTRIES = Gauge("prefixd_route_index_entries", "Prefix boundaries indexed per backend.",
                      ["backend"], registry=REGISTRY)
MODEL_LOADS = Counter("prefixd_model_loads_total",
                      "Managed worker starts (model loads), by outcome (ready, failed).",
                      ["backend", "outcome"], registry=REGISTRY)
MODEL_LOAD_SECONDS = Histogram("prefixd_model_load_seconds",
                               "Time from spawning a managed worker to its first healthy "
                               "answer (its model loaded).", ["backend"], buckets=_LAT,
                               registry=REGISTRY)
MODEL_UNLOADS = Counter("prefixd_model_unloads_total",
                        "Managed workers that were ready and stopped, by reason (budget, group: "
                        "to make room; ttl: idle; failure: crashed or stopped answering).",
                        ["backend", "reason"], registry=REGISTRY)
MODEL_LOAD_WAIT = Histogram("prefixd_model_load_wait_seconds",
                            "Time a request for a model that was not ready waited for it: "
                            "room in the memory budget, then the worker's start.",
                            ["backend"], buckets=_LAT, registry=REGISTRY)
MODEL_FOOTPRINT = Gauge("prefixd_model_footprint_bytes",
                        "Memory of each managed model when loaded, as the budget counts it: "
                        "estimated, then measured by its worker once loaded.", ["backend"],
                        registry=REGISTRY)
MODEL_LOADED_BYTES = Gauge("prefixd_model_loaded_bytes",
                           "Footprint of each managed model that is loaded (0 when not): their "
                           "sum is what the memory budget holds now.", ["backend"],
                           registry=REGISTRY)
MODEL_MEMORY_BUDGET = Gauge("prefixd_model_memory_budget_bytes",
                            "PREFIXD_MODEL_MEMORY_BYTES: memory managed models may use.",
                            registry=REGISTRY)
SLOT_PINS = Counter("prefixd_slot_decisions_total",
                    "llama-server slot decisions: pinned (holds_prefix, spare_slot) or left to "
                    "the server (server, taken, unsettled, single_slot, untrusted, client).",
                    ["backend", "reason"], registry=REGISTRY)
