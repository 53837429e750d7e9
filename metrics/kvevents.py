"""What the router learns from the KV event streams it follows (`proxy/routing/follow.py`),
per backend (an endpoint, in the picker)."""

from prometheus_client import Counter, Gauge

from prefixd.metrics import REGISTRY

BATCHES = Counter("prefixd_kv_events_batches_total",
                  "KV event batches applied from a backend's stream.", ["backend"],
                  registry=REGISTRY)
EVENTS = Counter("prefixd_kv_events_total", "KV events applied, by type (stored, removed, "
                 "cleared).", ["backend", "type"], registry=REGISTRY)
BLOCKS = Gauge("prefixd_kv_events_blocks", "Blocks a backend has announced and not removed, "
               "by medium.", ["backend", "medium"], registry=REGISTRY)
COMPLETE = Gauge("prefixd_kv_events_complete", "1 when what the router applied of a "
                 "backend's stream covers it since its start (its announcements are trusted "
                 "alone), 0 when partial or not connected yet.", ["backend"], registry=REGISTRY)
DELAY = Gauge("prefixd_kv_events_delay_seconds", "Receipt time minus the publisher's time of "
              "the last batch.", ["backend"], registry=REGISTRY)
CREDITED = Counter("prefixd_route_event_credited_tokens_total",
                   "Prompt tokens routing credited to a backend from its KV events (for the "
                   "backend it chose).", ["backend"], registry=REGISTRY)
MISSES = Counter("prefixd_route_event_mispredictions_total",
                 "Requests whose backend reported fewer cached tokens than its KV events "
                 "credited it.", ["backend"], registry=REGISTRY)
