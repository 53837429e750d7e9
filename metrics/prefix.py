"""Prefix-report and canonicalization metrics. Labels take fixed values only: `client` from a
small User-Agent map, `verdict`, `region` and `cause` from the catalogue, `rule` from the
canonicalization rules; never lane or session ids."""

from prometheus_client import Counter, Gauge, Histogram

from prefixd.metrics import REGISTRY

REQUESTS = Counter("prefixd_prefix_requests_total",
                   "Requests compared with their lane's previous request, by client and verdict.",
                   ["client", "verdict"], registry=REGISTRY)
MUTATIONS = Counter("prefixd_prefix_mutations_total",
                    "Prefix mutations as forwarded, by client, region (model|params|tools|system|"
                    "messages) and cause.", ["client", "region", "cause"], registry=REGISTRY)
LOST_TOKENS = Counter("prefixd_prefix_lost_tokens_total",
                      "Previously cached prompt tokens a mutation made unusable (estimated or "
                      "exact), by client and first cause.", ["client", "cause"], registry=REGISTRY)
REUSE_RATIO = Histogram("prefixd_prefix_reuse_ratio",
                        "Share of the lane's previous prompt that the new request can reuse.",
                        ["client"], buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0),
                        registry=REGISTRY)
UNEXPLAINED_MISS = Counter("prefixd_prefix_unexplained_miss_total",
                           "Backend cache misses the prompt diff does not explain, by first "
                           "suspect (eviction, checkpoint_granularity, template, restart).",
                           ["suspect"], registry=REGISTRY)
CANON_APPLIED = Counter("prefixd_canonicalize_applied_total",
                        "Requests a canonicalization rule rewrote (mode=on) or would have "
                        "rewritten (mode=dry_run).", ["rule", "mode"], registry=REGISTRY)
CANON_SAVED = Counter("prefixd_canonicalize_saved_tokens_total",
                      "Prompt tokens kept reusable by a rule (mode=on) or that it would have "
                      "kept (mode=dry_run), estimated.", ["rule", "mode"], registry=REGISTRY)
LANES = Gauge("prefixd_prefix_lanes", "Lanes (conversations) currently remembered.",
              registry=REGISTRY)
LANE_BYTES = Gauge("prefixd_prefix_lane_bytes", "Approximate bytes of lane state in memory.",
                   registry=REGISTRY)
