"""Log-probabilities of generated tokens and their two OpenAI shapes. Pure; no mlx.

The log-probabilities are those the sampler was given: the model's distribution after logit
processors (bias, penalties) and before temperature, top-p/top-k (as mlx-lm reports them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its text, log-probability and the most likely alternatives."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion (or of one stream chunk)."""
    return {"content": [{**_entry(t.token, t.logprob),
                         "top_logprobs": [_entry(s, lp) for s, lp in t.top]} for t in items],
            "refusal": None}


def completion_logprobs(items: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """`choices[i].logprobs` of a text completion (or of one stream chunk); `offset` is where
    the first token starts in the completion text (text_offset)."""
    offsets = []
    for t in items:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in items],
            "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [dict(t.top) for t in items],
            "text_offset": offsets}
