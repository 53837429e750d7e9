"""What one request did, gathered along the pipeline and emitted once at the end: the
request metrics and exactly one log line (text or JSON)."""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

from prefixd.api.usage import Usage
from prefixd.metrics import proxy as m

log = logging.getLogger("prefixd.request")


@dataclass
class RequestTrace:
    request_id: str
    started: float = field(default_factory=time.monotonic)
    backend: str | None = None
    model: str | None = None
    status: int | None = None
    error: str | None = None
    queue_wait: float | None = None
    first_token_at: float | None = None
    usage: Usage | None = None
    upstream_status: int | None = None
    completed: bool = False       # the last byte of the answer was sent
    transfer: str | None = None   # a prefix state moved in first: "<source>:<outcome>:<tokens>"
    max_tokens: str | None = None  # clamped to the window's room: "<asked>-><sent>"
    grammar_ms: float | None = None  # compiling its JSON schemas (structured output)

    def tokens(self) -> tuple[int | None, int | None, int | None]:
        u = self.usage or Usage()
        return u.prompt, u.cached, u.completion

    def waited(self) -> float | None:
        """Time spent waiting behind other requests: in prefixd's queue for the backend, then
        (a prefixd worker) in the worker's own queue and paused while others' passes ran."""
        behind = self.usage.behind_s() if self.usage else None
        if self.queue_wait is None and behind is None:
            return None
        return (self.queue_wait or 0.0) + (behind or 0.0)

    def fields(self) -> dict[str, Any]:
        prompt, cached, completion = self.tokens()
        ttft = (self.first_token_at - self.started) if self.first_token_at else None
        return {
            "request_id": self.request_id, "backend": self.backend, "model": self.model,
            "status": self.status, "queue_wait_s": _r(self.queue_wait),
            "waited_s": _r(self.waited()), "ttft_s": _r(ttft),
            "duration_s": _r(time.monotonic() - self.started), "prompt_tokens": prompt,
            "cached_tokens": cached, "completion_tokens": completion,
            "transfer": self.transfer, "max_tokens": self.max_tokens,
            "grammar_ms": self.grammar_ms, "error": self.error,
        }

    def finish(self, log_format: str) -> None:
        f = self.fields()
        backend, model = self.backend or "-", self.model or "-"
        m.REQUESTS.labels(backend, model, str(self.status or 0)).inc()
        m.REQUEST_DURATION.labels(backend, model).observe(f["duration_s"])
        if f["ttft_s"] is not None and self.status == 200:
            m.TTFT.labels(backend, model).observe(f["ttft_s"])
        if f["waited_s"] is not None:
            m.WAITED.labels(backend).observe(f["waited_s"])
        prompt, cached, completion = self.tokens()
        for counter, value in ((m.PROMPT_TOKENS, prompt), (m.CACHED_TOKENS, cached),
                               (m.COMPLETION_TOKENS, completion)):
            if value is not None:
                counter.labels(backend, model).inc(value)
        level = logging.WARNING if (self.status or 0) >= 500 else logging.INFO
        if log_format == "json":
            log.log(level, json.dumps({"event": "request", **f}))
        else:
            log.log(level, "request %s", " ".join(f"{k}={_value(v)}" for k, v in f.items()
                                                  if v is not None or k == "status"))


_PLAIN = re.compile(r"[!#-<>-~]+")    # printable ASCII but space, `"` and `=`


def _value(v: Any) -> str:
    """A text-log value that cannot forge fields or lines: plain tokens as they are,
    anything else (spaces, quotes, `=`, control characters) JSON-quoted."""
    text = str(v)
    return text if _PLAIN.fullmatch(text) else json.dumps(text)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
