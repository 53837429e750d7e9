"""Authenticating prefix-state bundles between workers that share a transfer secret.

Owns: the bundle's MAC, an HMAC-SHA256 keyed with the `transfer_secret` setting over a fixed
context string and every byte of the bundle, carried in the `X-Prefixd-Bundle-Mac` header of
an export's answer and of the import request (the proxy copies it from one to the other,
`backends/worker_api.py`). A checksum alone proves nothing about who made a bundle (anyone can
recompute it); the MAC proves it comes from a worker holding the secret, so a bundle forged or
altered on its way is refused before anything of it is parsed or stored. The import side
computes it incrementally, chunk by chunk, as the body streams in.

Imports no mlx: the proxy side reads `HEADER` from here.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import TypeGuard

HEADER = "X-Prefixd-Bundle-Mac"
_CONTEXT = b"prefixd state bundle v1\x00"     # a MAC of this secret means nothing elsewhere
_WELL_FORMED = re.compile(r"[0-9a-f]{64}")


def signer(secret: str) -> hmac.HMAC:
    """A MAC to feed the bundle's bytes to, in order (`update`)."""
    return hmac.new(secret.encode(), _CONTEXT, hashlib.sha256)


def sign(secret: str, data: bytes) -> str:
    """The MAC of a whole bundle, as the header carries it (64 hex digits)."""
    mac = signer(secret)
    mac.update(data)
    return mac.hexdigest()


def well_formed(tag: str | None) -> TypeGuard[str]:
    return tag is not None and _WELL_FORMED.fullmatch(tag) is not None


def verifies(mac: hmac.HMAC, tag: str) -> bool:
    """Whether the bytes fed to `mac` are the ones `tag` was made for (constant time)."""
    return hmac.compare_digest(mac.hexdigest(), tag)
