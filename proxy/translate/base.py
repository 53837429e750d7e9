"""The contract every client-API translator keeps, its error, and the checks and SSE framing
the translators share.

A `Translator` is stateless (one instance serves every request); `stream()` hands out the
per-response state. Requests are validated on the way in (`TranslateError`, a 400 for the
pipeline); what comes back from the upstream is never trusted and never raises.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from typing import Any

from prefixd.api.errors import ApiError


class TranslateError(Exception):
    """A client mistake in a request body; `param` names the field, e.g. `messages.3.content`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


class StreamTranslator(ABC):
    """One streamed answer: upstream chat chunks in, the client's SSE bytes out.
    `prompt_tokens`: the prompt's size as the proxy counted it before sending (exact, or an
    estimate), for an API that states it when the answer starts; the upstream's own usage
    replaces it at the end."""

    prompt_tokens: int | None = None

    @abstractmethod
    def feed(self, chunk: dict) -> bytes:
        """One parsed `chat.completion.chunk` -> SSE bytes for the client (may be b"").
        Never raises: what cannot be read is skipped."""

    @abstractmethod
    def finish(self) -> bytes:
        """The upstream ended normally ([DONE] or EOF): the closing events. Idempotent."""

    @abstractmethod
    def error(self, body: dict) -> bytes:
        """A mid-stream failure: this API's SSE error event(s) (`body` from `error_body`).
        Ends the stream: later `feed`/`finish` calls return b""."""


class Translator(ABC):
    api: str       # "anthropic" | "responses"
    path: str      # the client route, e.g. "/v1/messages"

    @abstractmethod
    def request(self, body: dict) -> dict:
        """Client body -> /v1/chat/completions body ("model" and "stream" carried over; streams
        always ask for usage). Raises `TranslateError` on bad input."""

    def chat_request(self, body: dict) -> dict:
        """`request`, its bad input a 400 in the API's error vocabulary (`ApiError`)."""
        try:
            return self.request(body)
        except TranslateError as e:
            raise ApiError(400, e.message, param=e.param, code="invalid_request") from None

    @abstractmethod
    def response(self, chat: dict, client: dict | None = None) -> dict:
        """A non-streamed `chat.completion` object -> the client's response object (`client`:
        the request as the client sent it, for an API whose response repeats its fields)."""

    @abstractmethod
    def stream(self, client: dict | None = None) -> StreamTranslator:
        """A fresh per-response stream state (`client` as in `response`)."""

    def client_param(self, body: dict, param: str) -> str:
        """A field of the translated chat body (`param`, e.g. `tools[0].function.parameters`)
        as the field of the client's `body` it came from (`translate/params.py`)."""
        return param

    @abstractmethod
    def error_body(self, status: int, type_: str, message: str, param: str | None,
                   code: str | None) -> dict:
        """An error (OpenAI-style type, e.g. `rate_limit_error`) in this API's shape."""


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One SSE event with an `event:` line, compact JSON on one `data:` line."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {payload}\n\n".encode()


def new_id(prefix: str) -> str:
    """A fresh id in the client API's style, e.g. `msg_…`, `toolu_…`, `resp_…`."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stream_fields(body: dict, chat: dict) -> None:
    """Carry `model` and `stream` over; a stream always asks for usage (the final chunk)."""
    if "model" in body:
        chat["model"] = want(body, "model", str, "a string")
    if want(body, "stream", bool, "a boolean"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    elif "stream" in body and body["stream"] is not None:
        chat["stream"] = False


_NUMBER = (int, float)


def want(obj: dict, key: str, types: type | tuple[type, ...], what: str,
         param: str | None = None) -> Any:
    """obj[key] if present and of `types` (bool is never a number), None if absent or null."""
    value = obj.get(key)
    if value is None:
        return None
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in
                                           (types if isinstance(types, tuple) else (types,)))
    if not ok:
        name = param or key
        raise TranslateError(f"'{name}' must be {what}", name)
    return value


def want_number(obj: dict, key: str, param: str | None = None) -> float | int | None:
    return want(obj, key, _NUMBER, "a number", param)


def copy_sampling(body: dict, chat: dict, keys: dict[str, str]) -> None:
    """Copy numeric sampling fields, renamed client -> chat (`{"top_p": "top_p"}`)."""
    for src, dst in keys.items():
        value = want(body, src, int, "an integer") if src == "top_k" else want_number(body, src)
        if value is not None:
            chat[dst] = value
