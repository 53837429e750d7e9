"""window: the attempt's backend's context window, enforced before anything is computed. A
prompt that does not fit is refused (400, code `context_length_exceeded`; Anthropic's
`invalid_request_error` "prompt is too long: N tokens > M maximum"), and a `max_tokens` larger
than the room the prompt leaves is cut to that room (`attempt.clamp`: the forwarded body, the
`X-Prefixd-Max-Tokens` header and the log line's `max_tokens`). Per attempt, because the
window is the backend's.

The prompt's tokens, in this order:
- none counted when nothing can be over: the forwarded body's UTF-8 bytes (a token is at least
  one byte of the text it renders) plus `TEMPLATE_TOKENS` (what a chat template adds) plus the
  asked `max_tokens` fit the window;
- exact from the backend's tokenizer (`Attempt.tokenize`: the one the measure stage may already
  have asked for this body), within `TOKENIZE_TIMEOUT_S`;
- else a low estimate, the rendered text's characters / `CHARS_PER_TOKEN_MAX` (5: ordinary
  text and code run 3-4.5 characters a token). It refuses only a prompt clearly over (more than
  1.25x the window at 4 characters a token), and a clamp on it never cuts below the room the
  prompt really leaves: an estimate must not refuse or shorten a request that fits.

No window known (not configured, not reported): nothing is refused or clamped here.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from prefixd.api.errors import ApiError
from prefixd.proxy.attempt import Clamp
from prefixd.proxy.exchange import Exchange
from prefixd.proxy.prefix.segments import rendered_chars
from prefixd.proxy.stages import Next

TEMPLATE_TOKENS = 1024       # a chat template's own text: roles, tool instructions, defaults
TOKENIZE_TIMEOUT_S = 2.0
CHARS_PER_TOKEN_MAX = 5


@dataclass(frozen=True)
class Count:
    tokens: int
    exact: bool


class WindowStage:
    name = "window"

    async def __call__(self, ex: Exchange, call_next: Next) -> None:
        assert ex.attempt is not None and ex.parsed is not None
        attempt = ex.attempt
        window = await attempt.backend.context_window()
        asked = ex.parsed.req.limit
        attempt.clamp, ex.trace.max_tokens = None, None
        if window is not None and not _fits_unseen(ex, window, asked):
            count = await _count(ex)
            if count is not None:
                attempt.prompt_tokens = count.tokens
                param = "messages" if ex.api.kind == "chat" else "prompt"
                if ex.api.translator is not None:
                    param = ex.api.translator.client_param(ex.client_body, param)
                attempt.clamp = decide(count, window, asked, attempt.backend.name, param)
        if attempt.clamp is not None:
            ex.trace.max_tokens = f"{attempt.clamp.asked}->{attempt.clamp.sent}"
        await call_next(ex)


def decide(count: Count, window: int, asked: int | None, backend: str,
           param: str) -> Clamp | None:
    """Refuse a prompt that leaves no room to answer (raises the 400); else the clamp of
    `asked` to the room left, or None when it fits."""
    if count.tokens >= window:
        how = "" if count.exact else "an estimate; "
        # the window as /v1/models states it; a prompt filling it exactly leaves no room
        over = f"> {window} maximum" if count.tokens > window else \
            f"= {window} maximum, no room left to answer"
        raise ApiError(400, f"prompt is too long: {count.tokens} tokens {over} ({how}backend "
                       f"{backend} has a context window of {window} tokens)", param=param,
                       code="context_length_exceeded")
    room = window - count.tokens
    return Clamp(asked, room, window) if asked is not None and asked > room else None


def _prompt_body(ex: Exchange) -> dict:
    assert ex.parsed is not None
    return ex.prepared.body if ex.prepared is not None else ex.parsed.body


def _fits_unseen(ex: Exchange, window: int, asked: int | None) -> bool:
    """Nothing can be over, whatever the tokenizer: bytes + template + the answer asked fit
    (no `max_tokens`: the backend's own default, which it bounds itself)."""
    assert ex.parsed is not None
    if ex.prepared is not None and ex.prepared.changed:
        size = len(json.dumps(ex.prepared.body, ensure_ascii=False).encode())
    else:
        size = len(ex.parsed.raw)
    return size + TEMPLATE_TOKENS + (asked or 0) <= window


async def _count(ex: Exchange) -> Count | None:
    """The forwarded prompt's tokens: exact where the backend tells them in time, else the low
    estimate, else None (nothing to estimate from)."""
    assert ex.attempt is not None
    body = _prompt_body(ex)
    ids = _token_ids(body)
    if ids is not None:
        return Count(len(ids), True)
    try:
        async with asyncio.timeout(TOKENIZE_TIMEOUT_S):
            tokens = await ex.attempt.tokenize(body)
    except TimeoutError:
        tokens = None
    if tokens is not None:
        return Count(len(tokens), True)
    chars = rendered_chars(ex.prepared.segments) if ex.prepared is not None else 0
    return Count(chars // CHARS_PER_TOKEN_MAX, False) if chars else None


def _token_ids(body: dict) -> list[int] | None:
    """A completions prompt given as token ids (a batch of one): its count is its length."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    return None
