"""llama-server's slots as the server reports them: `/props` (`ServerInfo`), `/slots`
(`SlotState`), and the one start-up advice line where its settings defeat caching. Which slot a
conversation runs in is routing's decision (`proxy/routing/slots.py`), from these facts.

How llama-server places requests and why prefixd pins only some: `proxy/routing/slotbook.py`.

Owns: parsing `/props` and `/slots` (nothing from the server is trusted) and the advice line.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prefixd.api.values import integer

log = logging.getLogger("prefixd.backend")

MIN_CACHE_RAM_MIB = 1024  # a smaller --cache-ram holds next to no conversation of an agent
Fetch = Callable[[str], Awaitable[Any]]   # GET a path of the server -> its JSON (or None)


@dataclass(frozen=True)
class ServerInfo:
    """What a llama-server says of itself in `/props` (settings it does not report: None)."""

    total_slots: int
    n_ctx: int | None = None            # per slot
    similarity: float | None = None     # -sps / --slot-prompt-similarity
    cache_ram_mib: int | None = None    # --cache-ram
    build: str = ""


@dataclass(frozen=True)
class SlotState:
    """One entry of `GET /slots`."""

    id: int
    n_ctx: int | None
    is_processing: bool
    id_task: int | None = None
    n_prompt_tokens: int = 0           # what the slot holds now (prompt + generated)
    n_cached: int | None = None        # its last task: prompt tokens it reused ...
    n_processed: int | None = None     # ... and computed
    seed: int | None = None            # ... and its sampling seed


def _num(*dicts: Any, keys: tuple[str, ...]) -> float | None:
    for d in dicts:
        if isinstance(d, dict):
            for k in keys:
                v = d.get(k)
                if isinstance(v, int | float) and not isinstance(v, bool):
                    return v
    return None


def parse_props(obj: Any) -> ServerInfo | None:
    """A llama-server's `/props`, or None when the answer is not one (no `total_slots`)."""
    if not isinstance(obj, dict):
        return None
    total = integer(obj.get("total_slots"))
    if total is None or total < 1:
        return None
    dgs = obj.get("default_generation_settings")
    params = dgs.get("params") if isinstance(dgs, dict) else None
    n_ctx = _num(dgs, obj, keys=("n_ctx",))
    sim = _num(obj, dgs, params, keys=("slot_prompt_similarity", "sps"))
    ram = _num(obj, dgs, params, keys=("cache_ram_mib", "cache_ram"))
    return ServerInfo(total, None if n_ctx is None else int(n_ctx), sim,
                      None if ram is None else int(ram), str(obj.get("build_info") or ""))


def parse_slots(obj: Any) -> list[SlotState]:
    """`GET /slots` (a list of slots; anything else: no slots)."""
    out = []
    for s in obj if isinstance(obj, list) else []:
        slot = integer(s.get("id")) if isinstance(s, dict) else None
        if slot is None:
            continue
        params = s.get("params")
        seed = integer(params.get("seed")) if isinstance(params, dict) else None
        out.append(SlotState(slot, integer(s.get("n_ctx")), bool(s.get("is_processing")),
                             integer(s.get("id_task")), integer(s.get("n_prompt_tokens")) or 0,
                             integer(s.get("n_prompt_tokens_cache")),
                             integer(s.get("n_prompt_tokens_processed")), seed))
    return out


def advice(name: str, info: ServerInfo) -> tuple[int, str]:
    """The one line logged when a backend turns out to be llama-server: what it has, and
    the flag to change where its settings defeat caching (WARNING then, else INFO)."""
    ctx = f" of {info.n_ctx} tokens" if info.n_ctx else ""
    head = f"backend {name}: llama-server with {info.total_slots} slot(s){ctx}"
    fixes = []
    if info.similarity is not None and info.similarity > 0:
        fixes.append(f"-sps {info.similarity:g} lets a new conversation take over the slot "
                     "of a similar one without saving it: restart with -sps 0")
    if info.cache_ram_mib is not None and 0 <= info.cache_ram_mib < MIN_CACHE_RAM_MIB:
        what = "disables" if info.cache_ram_mib == 0 else "leaves almost no room for"
        fixes.append(f"--cache-ram {info.cache_ram_mib} {what} its RAM prompt cache, so "
                     "conversations beyond its slots recompute: restart with --cache-ram 8192 "
                     "(or more)")
    if fixes:
        return logging.WARNING, f"{head}; {'; '.join(fixes)}"
    unknown = [f for f, v in (("-sps", info.similarity), ("--cache-ram", info.cache_ram_mib))
               if v is None]
    if unknown:
        return logging.INFO, (f"{head}; it does not report {' or '.join(unknown)}: for cache "
                              "reuse run it with -sps 0 and --cache-ram 8192 (the default) or "
                              "more")
    return logging.INFO, f"{head}; -sps 0 and a RAM prompt cache: slot settings keep caches"


async def detect_server(name: str, fetch: Fetch) -> ServerInfo | None:
    """A llama-server behind `fetch` (its `/props`), or None; logs the one advice line."""
    info = parse_props(await fetch("/props"))
    if info is None:
        return None
    level, line = advice(name, info)
    log.log(level, "%s", line)
    return info
