"""From sampled token ids to what the client gets: text deltas (detokenized, cut at stop
strings) and the log-probabilities of the tokens behind each delta. Runs on the generation
thread; the mlx sampler and logits processors are built here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from prefixd.backends.mlx.chat import Sampling
from prefixd.backends.mlx.logprobs import TokenLogprob
from prefixd.backends.mlx.oai import StopMatcher


@dataclass(frozen=True)
class Delta:
    """Text to send, and the log-probabilities of the tokens it came from (if asked for)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


def sampling_functions(s: Sampling, vocab: int, grammar: Any = None
                       ) -> tuple[Callable[[Any], Any], list[Any]]:
    """mlx-lm's sampler and logits processors, then `grammar` (structured output's mask,
    `grammar_run.py`) last, so no bias or penalty can bring back a token it forbids. A `top_k`
    of the vocabulary's size or more keeps every token (mlx-lm raises on it, inside its
    compiled sampler)."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    top_k = s.top_k if 0 < s.top_k < vocab else 0
    sampler = make_sampler(s.temperature, s.top_p, s.min_p, top_k=top_k)
    processors = make_logits_processors(
        s.logit_bias, s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty)
    if grammar is not None:
        processors.append(grammar)
    return sampler, processors


class LogprobTap:
    """The sampler, keeping the log-probabilities it was given, so the chosen token's and the
    `top` most likely ones can be reported (`logprobs` requests only)."""

    def __init__(self, sampler: Callable[[Any], Any], top: int, tokenizer: Any) -> None:
        self.sampler, self.top, self.tokenizer = sampler, top, tokenizer
        self.lp: Any = None

    def __call__(self, lp: Any) -> Any:
        self.lp = lp
        return self.sampler(lp)

    def take(self, token: int) -> TokenLogprob:
        import mlx.core as mx

        row = self.lp.reshape(-1).astype(mx.float32)
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

    def __init__(self, emit: Callable[[Delta], None], stops: tuple[str, ...], detok: Any) -> None:
        self.emit, self.detok = emit, detok
        self.stops = StopMatcher(stops)
        self._logprobs: list[TokenLogprob] = []

    def add(self, token: int, logprob: TokenLogprob | None) -> None:
        self.detok.add_token(token)
        if logprob is not None:
            self._logprobs.append(logprob)
        self._send(self.stops.feed(self.detok.last_segment))

    def finish(self) -> None:
        """The rest of the text once generation ended (nothing after a stop string)."""
        if self.stops.hit:
            return
        self.detok.finalize()
        self._send(self.stops.feed(self.detok.last_segment) + self.stops.flush(), last=True)

    def _send(self, text: str, last: bool = False) -> None:
        # Tokens whose text is held back (a possible stop string) wait for the next delta; those
        # of a stop string itself are never sent.
        if text or (last and self._logprobs):
            self.emit(Delta(text, tuple(self._logprobs)))
            self._logprobs = []
