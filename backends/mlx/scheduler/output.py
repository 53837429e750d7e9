"""From sampled token ids to what the client gets: text deltas (detokenized, cut at stop
strings, `stop_strings`) and the log-probabilities of the tokens behind each delta. Runs on the
generation thread; the mlx sampler and logits processors are built here too.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from prefixd.backends.mlx.chat.logprobs import TokenLogprob
from prefixd.backends.mlx.chat.oai import ToolFormat
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.chat.stops import StopMatcher


@dataclass(frozen=True)
class Delta:
    """Text to send, and the log-probabilities of the tokens it came from (if asked for)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


def sampling_functions(s: Sampling, vocab: int, grammar: Any = None
                       ) -> tuple[Callable[[Any], Any], list[Any]]:
    """mlx-lm's sampler and logits processors, then `grammar` (structured output's mask,
    `grammar/matcher.py`) last, so no bias or penalty can bring back a token it forbids. A `top_k`
    of the vocabulary's size or more keeps every token (mlx-lm raises on it, inside its
    compiled sampler). A request with a `seed` samples from its own random key
    (`SeededSampler`), so jobs interleaved on the thread cannot change each other's draws."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    top_k = s.top_k if 0 < s.top_k < vocab else 0
    sampler: Callable[[Any], Any] = make_sampler(s.temperature, s.top_p, s.min_p, top_k=top_k)
    if s.seed is not None and s.temperature > 0:
        sampler = SeededSampler(s, top_k, s.seed)
    processors = make_logits_processors(
        s.logit_bias, s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty)
    if grammar is not None:
        processors.append(grammar)
    return sampler, processors


class SeededSampler:
    """mlx-lm's sampling chain (top-p, min-p, top-k, then a categorical draw at the
    temperature) with the job's own key instead of MLX's global random state: split once per
    token exactly as the global state is, so a seeded request draws the tokens it would
    alone (and as it did when the worker reseeded the global state) however many jobs run
    between its steps."""

    def __init__(self, s: Sampling, top_k: int, seed: int) -> None:
        import mlx.core as mx
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        self.methods: list[Callable[[Any], Any]] = []
        if 0 < s.top_p < 1.0:
            self.methods.append(lambda x: apply_top_p(x, s.top_p))
        if s.min_p != 0.0:
            self.methods.append(lambda x: apply_min_p(x, s.min_p))
        if top_k > 0:
            self.methods.append(lambda x: apply_top_k(x, top_k))
        self.scale, self.key = 1.0 / s.temperature, mx.random.key(seed & 0xFFFFFFFFFFFFFFFF)
        self.keys: list[Any] = []   # the key before each of the last draws (`rewind`)

    def __call__(self, logprobs: Any) -> Any:
        import mlx.core as mx

        for method in self.methods:
            logprobs = method(logprobs)
        self.keys = [*self.keys[-(REWIND - 1):], self.key]
        self.key, draw = mx.random.split(self.key)
        return mx.random.categorical(logprobs * self.scale, key=draw)

    def rewind(self, draws: int) -> None:
        """Undo the last `draws` draws (a verify pass drew tokens it did not emit,
        `engine/spec/speculate.py`): the key is the one the next emitted token draws with."""
        self.key, self.keys = self.keys[-draws], self.keys[:-draws]


# draws a sampler can undo: a verify pass's (the longest draft + 1), with room
REWIND = 80


class LogprobTap:
    """The sampler, keeping the log-probabilities it was given, so the chosen token's and the
    `top` most likely ones can be reported (`logprobs` requests only)."""

    def __init__(self, sampler: Callable[[Any], Any], top: int, tokenizer: Any) -> None:
        self.sampler, self.top, self.tokenizer = sampler, top, tokenizer
        self.lps: list[Any] = []   # of the draws not yet taken, in order

    def __call__(self, lp: Any) -> Any:
        token = self.sampler(lp)
        self.lps.append(lp)
        return token

    def rewind(self, draws: int) -> None:
        """Undo the last `draws` draws (`SeededSampler.rewind`)."""
        del self.lps[-draws:]
        inner = getattr(self.sampler, "rewind", None)
        if inner is not None:
            inner(draws)

    def take(self, token: int) -> TokenLogprob:
        import mlx.core as mx

        row = self.lps.pop(0).reshape(-1).astype(mx.float32)
        top: tuple[tuple[str, float], ...] = ()
        k = min(self.top, row.size)
        if k:
            ids = mx.argpartition(-row, k - 1)[:k]
            ids = ids[mx.argsort(-row[ids])]
            # 1-D arrays: lists (mlx's stub gives `tolist` every form an array may take)
            pairs = zip(cast(list[int], ids.tolist()), cast(list[float], row[ids].tolist()),
                        strict=True)
            top = tuple((self._text(i), v) for i, v in pairs)
        return TokenLogprob(self._text(token), float(row[token].item()), top)

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])


class TextOut:
    """Generated tokens to text deltas: detokenized, cut at stop strings (`StopMatcher`), each
    delta with the log-probabilities of the tokens it came from."""

    def __init__(self, emit: Callable[[Delta], None], stops: tuple[str, ...], detok: Any,
                 until: str | None = None) -> None:
        self.emit, self.detok = emit, detok
        self.stops = StopMatcher(stops, until)
        self._logprobs: list[TokenLogprob] = []
        self._ends: list[int] = []   # characters of text after each token added

    def add(self, token: int, logprob: TokenLogprob | None) -> None:
        self.detok.add_token(token)
        if logprob is not None:
            self._logprobs.append(logprob)
        segment = self.detok.last_segment
        self._ends.append((self._ends[-1] if self._ends else 0) + len(segment))
        self._send(self.stops.feed(segment))

    def stop_token(self) -> int:
        """The index of the token whose text the stop string found (or the text held back)
        begins in (as the detokenizer attributed text to tokens)."""
        return bisect.bisect_right(self._ends, self.stops.start)

    def finish(self) -> None:
        """The rest of the text once generation ended (nothing after a stop string). A stop
        string held back until now (a call's marker might have followed it) ends the text
        here: the tokens from the one it begins in are not sent, as at any stop string."""
        if self.stops.hit:
            return
        self.detok.finalize()
        text = self.stops.feed(self.detok.last_segment) + self.stops.flush()
        if self.stops.hit:
            first = len(self._ends) - len(self._logprobs)   # the first token not sent yet
            del self._logprobs[max(0, self.stop_token() - first):]
        self._send(text, last=True)

    def _send(self, text: str, last: bool = False) -> None:
        # Tokens whose text is held back (a possible stop string) wait for the next delta; those
        # of a stop string itself are never sent.
        if text or (last and self._logprobs):
            self.emit(Delta(text, tuple(self._logprobs)))
            self._logprobs = []


def stop_strings(s: Sampling, fmt: ToolFormat) -> tuple[tuple[str, ...], str | None]:
    """The stop strings a reply is cut at, and where they stop applying: a reply that is all
    structure (a `response_format` schema, a required or named tool call) has none; with tools
    a model may call, they apply to the text before its first call's opening marker. A stop
    string cutting a call or a schema's JSON would send markup as text, or JSON that does not
    parse, as a finished answer."""
    c = s.constraint
    if c is not None and (c.schema is not None or (c.tools and c.required)):
        return (), None
    return s.stop, fmt.start if c is not None and c.tools else None
