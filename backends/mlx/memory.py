"""What the worker process holds in memory, for the "memory" object of GET /v1/cache: the
proxy's model pool replaces its estimate of a loaded model's footprint by this
(`backends/budget.py`, `measured_footprint`).

`process_rss()` reads the OS (no mlx); `mlx_memory()` asks MLX's allocator and runs on the
generation thread (with the Engine), so the HTTP handler only reads the last snapshot.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any


def process_rss() -> tuple[int, str]:
    """(bytes, source): the resident set now (Linux, /proc/self/statm), else the peak
    resident set the OS reports (`ru_maxrss`: bytes on macOS, KiB elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE"), "statm"
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak * (1 if sys.platform == "darwin" else 1024), "maxrss"


def mlx_memory() -> dict[str, int]:
    """MLX's allocator: memory in live arrays, memory kept for reuse (its buffer cache), and
    the peak of live arrays since start. Call it on the generation thread."""
    import mlx.core as mx

    return {"mlx_active_bytes": int(mx.get_active_memory()),
            "mlx_cache_bytes": int(mx.get_cache_memory()),
            "mlx_peak_bytes": int(mx.get_peak_memory())}


def memory_info(mlx_snapshot: dict[str, Any]) -> dict[str, Any]:
    """The "memory" object of GET /v1/cache: the process's RSS now and MLX's last snapshot."""
    rss, source = process_rss()
    return {"rss_bytes": rss, "rss_source": source, **mlx_snapshot}
