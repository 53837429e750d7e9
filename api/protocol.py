"""Malformed HTTP (a request line, header or body framing that aiohttp refuses before any
handler runs), answered the same way by the proxy (`proxy/guard.py`) and the worker
(`backends/mlx/protocol.py`): a JSON error in the OpenAI shape, the connection closed, and at
most one bounded log line per kind every few seconds — never a traceback for a client's bytes
(a managed worker's stderr is the proxy's log; an attacker must not fill it). Both sockets'
connection protocols are `Cuttable`: a body that missed its deadline closes its connection.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from prefixd.api.errors import error_response

REASON_CHARS = 200          # of aiohttp's reason, which may quote the bytes it refused


class RateLimitedLog:
    """One warning per `key` at most every `every_s` seconds, counting what was left out."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.log, self.every_s = logger, every_s
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        last, skipped = self._last.get(key, (-self.every_s, 0))
        if now - last < self.every_s:
            self._last[key] = (last, skipped + 1)
            return
        self._last[key] = (now, 0)
        suffix = f" ({skipped} more since the last such line)" if skipped else ""
        self.log.warning(msg + suffix, *args)


def protocol_error(request: Any, status: int, exc: BaseException | None, message: str | None,
                   limited: RateLimitedLog, who: str) -> web.Response:
    """The answer to a request aiohttp could not handle (`RequestHandler.handle_error`): a
    client's malformed bytes (4xx, one line), or our own failure (5xx, with its traceback)."""
    if request.writer.output_size > 0:
        raise ConnectionError("response already started; cannot send an error")
    if status >= 500:
        limited.log.error("%s: error handling a request from %s", who, request.remote,
                          exc_info=exc)
        text, code = f"internal error in {who} (see its log)", "internal_error"
    else:
        # aiohttp's reason spans lines (it points at the byte): one line, bounded
        reason = " ".join(str(message or exc or "bad request").split())[:REASON_CHARS]
        limited.warning(f"protocol:{status}", "%s: malformed HTTP from %s: %s", who,
                        request.remote, reason)
        text, code = f"malformed HTTP request: {reason}", "bad_request"
    resp = error_response(status, text, code=code)
    resp.force_close()
    return resp


class Cuttable(RequestHandler):
    """aiohttp's connection protocol that a handler can cut: after this request's answer the
    connection closes at once, without aiohttp's lingering read of an unread body (up to 10 s
    of a trickling client's bytes). Used after a body missed its deadline
    (`api/reading.py`)."""

    def cut(self) -> None:
        self._lingering_time = 0.0        # aiohttp's: read nothing more, then close
