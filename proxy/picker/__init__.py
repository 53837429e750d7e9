"""`prefixd picker`: prefixd's router as the endpoint picker of a gateway (Envoy's ext_proc, the
Gateway API Inference Extension's endpoint-picker protocol), for a fleet of model servers
behind Envoy instead of behind `prefixd serve`.

Owns: the endpoints it picks from and what it knows of each now (`endpoints.py`: from the
settings' backends and from a file it re-reads when it changes; health and models probed;
requests in flight), reading a request as `prefixd serve` reads it and learning from its
answer (`reading.py`), one ext_proc stream per HTTP request (`extproc.py`), and the gRPC
server with its health service (`server.py`). The decision is the routing core's
(`proxy/routing/core.py`), the same as `prefixd serve`'s.
"""
