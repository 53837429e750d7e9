"""Prefix reports: lanes (which conversation a request belongs to), mutation detection
(where and why a request's prompt prefix diverged from its lane's previous request) and
canonicalization rules (opt-in rewrites that keep the prefix stable).

Owns: lane state (one `LaneStore`). Pure policy: no I/O, no event loop, no mlx.
"""
