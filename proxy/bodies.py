"""The bytes a backend receives: fields spliced into the client's JSON object, every other
byte as the client sent it (key order and spacing are part of a prompt prefix some servers
cache by bytes)."""

from __future__ import annotations

import json


def with_field(raw: bytes, key: str, value: object) -> bytes:
    """The same JSON object (UTF-8, as the parse stage requires: its first `{` byte is the
    object's) with `"key": value` first."""
    start = raw.index(b"{") + 1
    empty = raw[start:].lstrip().startswith(b"}")
    field = json.dumps(key).encode() + b":" + json.dumps(value, separators=(",", ":")).encode()
    return raw[:start] + field + (b"" if empty else b",") + raw[start:]
