"""Stop strings in generated text: cut at the first one, never letting one leak to the
client, even when it arrives split across tokens.

Owns: `StopMatcher`, which the scheduler's text output (`scheduler/output.py`) feeds a job's
decoded text and `oai.py` uses as a gate for markers (a tool call's opening, the end of a
think block). Pure; no mlx.
"""

from __future__ import annotations


class StopMatcher:
    """Cuts generated text at the first stop string, holding back any tail that could still
    become one, so a stop string split across tokens never reaches the client. `until`: the
    text stop strings apply to ends where it first appears (a tool call's opening marker: a
    call is markup, not text, and a stop string must not cut it)."""

    def __init__(self, stops: tuple[str, ...] | list[str], until: str | None = None) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.hit = False
        self.held = ""  # once hit: the stop string and all text fed after it
        self.matched: str | None = None   # once hit: which stop string
        self.until = until if until and self.stops else None
        self._tail = ""  # the last len(until) - 1 characters fed (where `until` may begin)
        # whether what it holds back (or the stop string it found) begins in the text fed last,
        # and where, in characters of all the text fed
        self.began_here = False
        self.start = 0
        self._fed = 0

    def feed(self, text: str) -> str:
        """Text safe to send now. After a stop string is seen (`hit`), nothing more; after
        `until`, everything (no stop string applies any more)."""
        if self.hit:
            self.held += text
            return ""
        if not self.stops:
            return text
        if self.until is not None:
            scan = self._tail + text
            at = scan.find(self.until)
            if at < 0:
                self._tail = scan[max(0, len(scan) - len(self.until) + 1):]
                return self._match(text)
            k = max(0, at - len(self._tail))     # characters of `text` before the marker
            out = self._match(text[:k])
            if self.hit:
                self.held += text[k:]
                return out
            out, self._fed = out + self._buf + text[k:], self._fed + len(text) - k
            self._buf, self.stops, self.until, self.began_here = "", [], None, False
            return out
        return self._match(text)

    def _match(self, text: str) -> str:
        before = len(self._buf)
        self._buf += text
        self._fed += len(text)
        first = self._first()
        cut = first[0] if first else -1
        if first and self._marker_may_begin(*first):
            # whether the stop string runs into a call's marker is not known yet: held
            out, self._buf = self._buf[:cut], self._buf[cut:]
            self.began_here, self.start = cut >= before, self._fed - len(self._buf)
            return out
        if first:
            self.matched = first[1]
            self.began_here = cut >= before
            self.start = self._fed - len(self._buf) + cut
            out, self.held, self._buf, self.hit = self._buf[:cut], self._buf[cut:], "", True
            return out
        keep = self._partial_tail()
        self.began_here = keep > 0 and len(self._buf) - keep >= before
        self.start = self._fed - keep
        out = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return out

    @property
    def holding(self) -> bool:
        """Whether it holds back text that could still become a stop string."""
        return bool(self._buf)

    def flush(self) -> str:
        """The held-back tail, once generation has ended without completing a stop string (a
        stop string held in it because a call's marker might have followed ends it there)."""
        first = None if self.hit else self._first()
        if first:
            cut, self.matched = first
            out, self.held, self.hit = self._buf[:cut], self._buf[cut:], True
            self.start, self._buf = self._fed - len(self.held), ""
            return out
        out, self._buf = ("" if self.hit else self._buf), ""
        return out

    def _first(self) -> tuple[int, str] | None:
        """Where the first stop string in the held text begins, and which (the longest of those
        that begin there)."""
        found = [(i, -len(s), s) for s in self.stops if (i := self._buf.find(s)) >= 0]
        return (min(found)[0], min(found)[2]) if found else None

    def _marker_may_begin(self, cut: int, stop: str) -> bool:
        """Whether a call's opening marker (`until`) may begin inside `stop`, found at `cut`:
        the text from there on is the marker's beginning."""
        end = min(cut + len(stop), len(self._buf))
        return self.until is not None and any(
            self.until.startswith(self._buf[p:]) for p in range(cut, end))

    def _partial_tail(self) -> int:
        for k in range(min(self._hold, len(self._buf)), 0, -1):
            tail = self._buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
