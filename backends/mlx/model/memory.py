"""The worker's memory: what it holds (for the proxy's model pool) and how big its cache tiers
may be by default (from what the machine has).

Owns: the "memory" object of GET /v1/cache (the process's resident set now and MLX's last
allocator snapshot; the pool replaces its estimate of a loaded model's footprint by it, see
`backends/budget.py`, `measured_footprint`), the RAM budget rule (a share of the memory still
available once the model is loaded, so the cache never pushes the machine into swap) and the
disk budget rule (a share of the free space where the cache lives, capped). Explicit settings
always win over the rules. `mlx_memory()` runs on the generation thread; the rest is pure or
reads the OS.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
from pathlib import Path
from typing import Any

import psutil

RAM_SHARE = 0.5              # of the memory available after the model loaded ...
RAM_RESERVE = 2 * 2**30      # ... after leaving this much for everything else
RAM_FLOOR = 256 * 2**20
DISK_SHARE = 0.25            # of the free space on the cache's file system ...
DISK_CAP = 32 * 2**30        # ... at most this


def auto_ram_bytes(available: int) -> int:
    """The RAM budget when PREFIXD_CACHE_BYTES is unset."""
    return max(RAM_FLOOR, int((available - RAM_RESERVE) * RAM_SHARE))


def auto_disk_bytes(free: int) -> int:
    """The disk budget when PREFIXD_DISK_CACHE_BYTES is unset."""
    return min(DISK_CAP, int(free * DISK_SHARE))


def available_memory() -> int:
    return int(psutil.virtual_memory().available)


def free_space(path: Path) -> int:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)    # the prompt cache: the user's only
    return shutil.disk_usage(path).free


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



def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's `malloc_trim`; elsewhere
    nothing). After a decode batch's join or leave (`engine/batch/executor.py`) has freed the
    copies it
    made: their buffers (a few MiB a layer) come from the heap, where glibc keeps what is freed
    resident. Measured on the built-in model: four sub-agents' batched second turns left the
    process at 1,393 MiB, and 1,187 MiB with the heap trimmed (unbatched: 1,145 MiB). A few
    milliseconds at most, and only when a request joins or leaves the batch. (A fixed
    `M_MMAP_THRESHOLD` does the same for every allocation and cost 10-20% of decode speed.)"""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim     # noqa: B018  (glibc only)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()
