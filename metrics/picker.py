"""The gateway picker's own metrics (`prefixd picker`); its routing decisions and index are
counted by the routing core's metrics in `proxy` (`prefixd_route_*`, the index's
`prefixd_route_index_entries` among them)."""

from prometheus_client import Counter, Gauge, Histogram

from prefixd.metrics import REGISTRY

PICKS = Counter("prefixd_picker_requests_total",
                "Requests the picker answered: picked, or refused with this status (429, 503, "
                "4xx).", ["outcome"], registry=REGISTRY)
PICK_SECONDS = Histogram("prefixd_picker_pick_seconds",
                         "Time from the request body's end to the pick sent back to Envoy "
                         "(reading the request, routing): the picker's added latency.",
                         buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025,
                                  0.05, 0.1, 0.25, 1), registry=REGISTRY)
IN_FLIGHT = Gauge("prefixd_picker_in_flight", "Requests this picker sent to an endpoint that "
                  "have not ended yet.", ["endpoint"], registry=REGISTRY)
ENDPOINT_UP = Gauge("prefixd_picker_endpoint_up", "1 when the endpoint answered its last "
                    "probe (GET /v1/models), else 0.", ["endpoint"], registry=REGISTRY)
LEARNED = Counter("prefixd_picker_answers_learned_total",
                  "Answers whose end the picker saw, by whether they reported usage.",
                  ["usage"], registry=REGISTRY)
