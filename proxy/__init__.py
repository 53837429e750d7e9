"""prefixd's proxy: the HTTP API, request parsing, settings, CLI, queues, routing and the
prefix pipeline (lanes, mutation detection, canonicalization).

Owns: every client-facing request from arrival to the last byte relayed; the per-backend
queues; the one `Settings` object. Must not import mlx (the worker process does that).
"""
