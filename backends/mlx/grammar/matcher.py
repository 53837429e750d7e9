"""Structured output, the decode side: the llguidance matcher of one reply, as an mlx-lm logits
processor that masks every token the grammar (`grammar.lark`) does not allow.

It only masks logits during decode: the prompt, its cache lookup and its checkpoints are
untouched, so a constrained request reuses and leaves the same prefix state as any other. The
processor is called once per decode step with the history (prompt + tokens so far); from the
second call on, the history's last token is the one sampled after the previous mask, and is
fed to the matcher first. Why llguidance (and its costs): docs/CLIENTS.md "Structured output".
Runs on the generation thread.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from prefixd.api.structured import Constraint
from prefixd.backends.mlx.chat.oai import ToolFormat
from prefixd.backends.mlx.grammar.lark import Markers, lark
from prefixd.metrics.worker import GRAMMAR_SECONDS

log = logging.getLogger("prefixd.worker")


class GrammarTokenizers:
    """llguidance's view of the loaded tokenizer, built on first use (~0.3 s for a 49K-token
    vocabulary) and kept for the model's lifetime."""

    def __init__(self) -> None:
        self._for: Any = None
        self._tok: Any = None

    def get(self, tokenizer: Any) -> Any:
        import llguidance

        if self._for is not tokenizer:
            backend = tokenizer._tokenizer.backend_tokenizer
            self._tok = llguidance.LLTokenizer(backend.to_str(), n_vocab=len(tokenizer),
                                               eos_token=list(tokenizer.eos_token_ids))
            self._for = tokenizer
        return self._tok


def markers(tokenizer: Any, fmt: ToolFormat, thinking: bool) -> Markers:
    """The tool-call markers (when the format's calls are JSON) and, if the prompt leaves a
    think block open (`chat.prompt.opens_think`), its end marker."""
    return Markers(call=(fmt.start, fmt.end) if fmt.json_body and fmt.end else None,
                   think_end=tokenizer.think_end if thinking else None)


class CallRepeats:
    """Whether the reply's latest tool call repeats an earlier one exactly: a small model
    (SmolLM2 with the text fallback) otherwise writes the same call again until `max_tokens`.
    Checked when the grammar could end the reply right after a call's end marker."""

    def __init__(self, decode: Callable[[list[int]], str], call: tuple[str, str]) -> None:
        self.decode, self.ids = decode, list[int]()
        self.end = call[1]
        self.block = re.compile(re.escape(call[0]) + r"(.*?)" + re.escape(call[1]), re.DOTALL)

    def repeated(self, token: int, accepting: bool) -> bool:
        """After `token`: True when it ends a call that repeats an earlier one (only checked
        where the grammar could end the reply, `accepting`)."""
        self.ids.append(token)
        if not accepting or not self.decode(self.ids[-8:]).rstrip().endswith(self.end):
            return False
        calls = [c.strip() for c in self.block.findall(self.decode(self.ids))]
        return len(calls) > 1 and calls[-1] in calls[:-1]


class GrammarMask:
    """The logits processor of one constrained reply. `repeats`: ends the reply (EOS only)
    once a call repeats an earlier one (`oai.extract_tool_calls` drops the repeat).

    Each call consumes the token before it (the one drawn at the previous call), then masks.
    Under speculative decoding (`engine/spec/speculate.py`) the calls run over a draft: a drafted
    token the grammar does not allow is not consumed (the draws from there on are discarded
    anyway: the draw before it, under the mask, differs from it), and `rewind` undoes the
    calls of the positions the verify pass did not keep (the matcher rolled back)."""

    LOG = 64     # calls `rewind` can undo (more than a verify pass has positions)

    def __init__(self, matcher: Any, vocab: int, eos: list[int],
                 repeats: CallRepeats | None = None) -> None:
        self.matcher, self.eos, self.repeats = matcher, eos, repeats
        self.words = np.zeros((vocab + 31) // 32, dtype=np.int32)
        self.started = False
        self.dead = False          # a drafted token it does not allow was met in this pass
        self.log: list[bool] = []  # per call since the first: whether it consumed its token

    def __call__(self, history: Any, logits: Any) -> Any:
        import mlx.core as mx

        m = self.matcher
        repeated = False
        if self.started:
            token = int(history[-1].item())
            consumed = not (self.dead or m.is_error()) and m.validate_tokens([token]) == 1
            self.dead = self.dead or not (consumed or m.is_error())
            self.log = [*self.log[-self.LOG + 1:], consumed]
            if self.dead:
                return logits
            if consumed:
                m.consume_token(token)
                repeated = self.repeats is not None and self.repeats.repeated(token,
                                                                              m.is_accepting())
        self.started = True
        if m.is_error() or repeated:  # an error cannot happen with our own masks: end the reply
            if m.is_error():          # rather than drift
                log.warning("worker: grammar error, ending the reply: %s", m.get_error()[:200])
            self.words[:] = 0
            for eos in self.eos:
                self.words[eos // 32] |= np.int32(1 << (eos % 32)) if eos % 32 < 31 else -(1 << 31)
        else:
            m.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        bits = np.unpackbits(self.words.view(np.uint8), bitorder="little")
        n = logits.shape[-1]
        allowed = np.zeros(n, dtype=bool)
        k = min(n, bits.size)
        allowed[:k] = bits[:k]
        return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), dtype=logits.dtype))

    def rewind(self, calls: int) -> None:
        """Undo the last `calls` calls: the tokens they consumed given back to the matcher
        (and to the repeat check)."""
        if calls <= 0:
            return
        undone, self.log = self.log[-calls:], self.log[:-calls]
        consumed = sum(undone)
        if consumed:
            self.matcher.rollback(consumed)
            if self.repeats is not None:
                del self.repeats.ids[-consumed:]
        self.dead = False


def grammar_mask(c: Constraint, tokenizers: GrammarTokenizers, tokenizer: Any, fmt: ToolFormat,
                 thinking: bool) -> GrammarMask | None:
    """The processor enforcing `c` on this reply, or None when there is nothing to enforce
    (tools in a format that is not JSON)."""
    import llguidance

    tok = tokenizers.get(tokenizer)

    def token(text: str) -> str:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) == 1 and tok.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    marks = markers(tokenizer, fmt, thinking)
    text = lark(c, marks, token)
    if text is None:
        return None
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(text),
                                   log_level=0)
    seconds = time.perf_counter() - t0
    GRAMMAR_SECONDS.observe(seconds)
    log.info("worker: grammar compiled grammar_ms=%.2f grammar_bytes=%d tools=%d", 1000 * seconds,
             len(text), len(c.tools))
    if matcher.is_error():  # schemas were checked at parse time: a bug, not a client mistake
        raise RuntimeError(f"grammar: {matcher.get_error()[:500]}")
    repeats = CallRepeats(lambda ids: str(tokenizer.decode(ids)), marks.call) \
        if c.tools and c.parallel and marks.call is not None else None
    return GrammarMask(matcher, tok.vocab_size, list(tokenizer.eos_token_ids), repeats)
