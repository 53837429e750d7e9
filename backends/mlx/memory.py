"""Default sizes of the worker's two cache tiers, from what the machine has.

Owns: the RAM budget rule (a share of the memory still available once the model is loaded,
so the cache never pushes the machine into swap) and the disk budget rule (a share of the free
space where the cache lives, capped). Explicit settings always win; these only fill in unset
ones. Pure functions of measured numbers, plus the two measurements (psutil, shutil).
"""

from __future__ import annotations

import shutil
from pathlib import Path

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
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free
