"""Reading untrusted JSON (what an upstream or a client sent) without re-checking it at every
use: a value as an integer, a count, an object or a list, or the empty/None answer. One rule
each, for every reader."""

from __future__ import annotations

from typing import Any

MAX_COUNT = 2**40


def integer(value: object) -> int | None:
    """A JSON integer (`true` is not one), any sign: ids and counts an upstream may mark -1."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def count(value: object, limit: int = MAX_COUNT) -> int | None:
    """A count as reported, if it is one: an integer from 0 below `limit`."""
    n = integer(value)
    return n if n is not None and 0 <= n < limit else None


def obj(value: object) -> dict[str, Any]:
    """The value if it is a JSON object, else an empty one."""
    return value if isinstance(value, dict) else {}


def arr(value: object) -> list[Any]:
    """The value if it is a JSON array, else an empty one."""
    return value if isinstance(value, list) else []


def seconds(value: object, limit: float = 1e7) -> float | None:
    """A duration as reported (a JSON number, not `true`), from 0 below `limit`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0 <= value < limit else None
