"""The shape both streaming translators share: upstream chunks go through one
`BlockSequencer` (text, reasoning and tool calls as numbered blocks) and come out as the API's
events. A subclass says how a stream opens (`_begin`), how block events render (`_render`),
how it closes (`_close`) and how it fails (`_fail`); the rest — nothing after the end, each
ending once — is here."""

from __future__ import annotations

from abc import abstractmethod

from prefixd.proxy.translate.base import StreamTranslator
from prefixd.proxy.translate.chat import BlockSequencer, Event


class BlockStream(StreamTranslator):
    def __init__(self) -> None:
        self._seq = BlockSequencer()
        self._started = self._done = False

    def feed(self, chunk: dict) -> bytes:
        if self._done:
            return b""
        events = self._seq.feed(chunk)           # first: it learns the model from the chunk
        return self._begin() + self._render(events)

    def finish(self) -> bytes:
        if self._done:
            return b""
        self._done = True
        events = self._seq.finish()
        return self._begin() + self._render(events) + self._close()

    def error(self, body: dict) -> bytes:
        if self._done:
            return b""
        self._done = True
        return self._fail(body)

    @abstractmethod
    def _begin(self) -> bytes:
        """The opening events, once (b"" after the first call)."""

    @abstractmethod
    def _render(self, events: list[Event]) -> bytes:
        """Block start/delta/stop events in the API's shape."""

    @abstractmethod
    def _close(self) -> bytes:
        """The closing events after the last block."""

    @abstractmethod
    def _fail(self, body: dict) -> bytes:
        """The API's error events for `body` (from `error_body`)."""
