"""The key a client presents, and the cache namespace it stands for under
`PREFIXD_CACHE_ISOLATION=per_key` (an opaque digest: the key itself never leaves the proxy;
the header that carries it to a prefixd worker is `api.schema.NAMESPACE_HEADER`)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping


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
