"""The key a client presents, the cache namespace it stands for under
`PREFIXD_CACHE_ISOLATION=per_key` (an opaque digest: the key itself never leaves the proxy;
the header that carries it to a prefixd worker is `api.schema.NAMESPACE_HEADER`), and what
the operator views (/status, /debug/prefix, the page that reads them, /metrics) show it.

The policy (pure; `app.py` applies it): under `shared` every caller the API key admits sees
everything. Under `per_key` a caller sees only its own namespace's lanes (another key's lane
is a 404, as one that does not exist), and /metrics, the traffic of every key, is the
operator's: the key `PREFIXD_OPERATOR_KEY` sees every lane and reads /metrics.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass


def presented_key(headers: Mapping[str, str]) -> bytes:
    """The key a client presents: `Authorization: Bearer <key>` or (Anthropic clients)
    `x-api-key: <key>`, as bytes (a header that is not UTF-8 compares as its raw bytes)."""
    got = headers.get("Authorization", "")
    token = got[7:] if got.lower().startswith("bearer ") else headers.get("x-api-key", "")
    return token.strip().encode("utf-8", "surrogateescape")


def cache_namespace(headers: Mapping[str, str], isolation: str) -> str:
    """"" (one shared cache), or under `per_key` a digest of the presented key: requests with
    the same key share cache entries, lanes and routing predictions, others never do."""
    if isolation != "per_key":
        return ""
    return hashlib.blake2b(presented_key(headers), digest_size=12,
                           person=b"prefixd-cache-ns").hexdigest()


def lane_scope(namespace: str) -> str:
    """The start of every lane id of a namespace ("" for the shared one): lane ids of two
    keys never coincide, and a view tells a key's lanes by it."""
    return f"{namespace[:16]}/" if namespace else ""


def is_key(headers: Mapping[str, str], key: str | None) -> bool:
    """The request presents `key` (compared in constant time); never when `key` is unset."""
    return bool(key) and hmac.compare_digest(presented_key(headers), (key or "").encode())


@dataclass(frozen=True, slots=True)
class Viewer:
    """What one caller may see on the operator views: every lane (`scope` None: the shared
    cache, or the operator key), or only the lanes of its own namespace."""

    scope: str | None

    @property
    def operator(self) -> bool:
        return self.scope is None

    def sees(self, lane: str) -> bool:
        return self.scope is None or lane.startswith(self.scope)


def viewer(headers: Mapping[str, str], isolation: str, operator_key: str | None) -> Viewer:
    """The caller's `Viewer`: everything under `shared` or with the operator key, else under
    `per_key` its own namespace's lanes."""
    if isolation != "per_key" or is_key(headers, operator_key):
        return Viewer(None)
    return Viewer(lane_scope(cache_namespace(headers, isolation)))
