"""One job under way on the generation thread: its Engine steps, one forward pass per
`advance`, and its output (text deltas, log-probabilities, the last event).

Owns: a job's sampler and grammar mask, its `engine.Turn` (its own stats and store entry, so
jobs under way together do not clobber each other), its end (`Finished` with the per-turn
breakdown and the restorable digest, or `Failed`). Driven to its end at once (max_active 1,
`generation.Generator._run`) or a pass at a time among others (`schedule.drive`); the same
code either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from typing import Any

from prefixd.backends.mlx.engine import Turn
from prefixd.backends.mlx.grammar_run import GrammarTokenizers, grammar_mask
from prefixd.backends.mlx.jobs import Event, Failed, Finished, Job
from prefixd.backends.mlx.loading import Loaded
from prefixd.backends.mlx.output import LogprobTap, TextOut, sampling_functions
from prefixd.backends.mlx.restorable import digest
from prefixd.backends.mlx.stats import PromptStats, breakdown, observe

log = logging.getLogger("prefixd.worker")


class Active:
    """One job under way: its Engine steps (one forward pass per `advance`) and its output.
    Nothing runs until the first `advance`, which restores and runs the first prefill pass."""

    def __init__(self, loaded: Loaded, grammars: GrammarTokenizers, job: Job,
                 slicer: Callable[[], int] | None, end: Callable[[Job, Event], None]) -> None:
        self.loaded, self.grammars, self.job, self._end = loaded, grammars, job, end
        self.turn = Turn(slicer)
        self.steps: Generator[int | None, None, None] | None = None
        self.n, self.finish, self.t0 = 0, "length", time.perf_counter()

    def remaining(self) -> int:
        run = self.turn.run
        return len(self.job.prompt.tokens) if run is None else len(run.prompt) - run.pos

    def advance(self) -> bool:
        """One forward pass; True once the job has ended (its last event sent). Never
        raises: a failure ends the job with `Failed`."""
        try:
            if not self._step():
                return False
            result: Event = self._result()
        except Exception as e:
            log.exception("worker: generation failed")
            if self.steps is not None:
                self.steps.close()  # commits what is in the KV state (never raises)
            result = Failed(f"generation failed: {type(e).__name__}: {e}")
            _reset_random_state()
        self._end(self.job, result)
        return True

    def _begin(self) -> Generator[int | None, None, None]:
        import mlx.core as mx

        engine, tokenizer, job = self.loaded.engine, self.loaded.tokenizer, self.job
        s = job.sampling
        if s.seed is not None:
            mx.random.seed(s.seed)
        mask = None if s.constraint is None else grammar_mask(
            s.constraint, self.grammars, tokenizer, self.loaded.renderer.tool_format(),
            job.prompt.tokens)
        sampler, processors = sampling_functions(s, len(tokenizer), mask)
        self.tap = None if job.logprobs is None else LogprobTap(sampler, job.logprobs, tokenizer)
        self.text = TextOut(job._emit, s.stop, tokenizer.detokenizer)
        self.eos = tokenizer.eos_token_ids
        return engine.steps(job.prompt.tokens, sampler=self.tap or sampler,
                            logits_processors=processors or None, max_tokens=job.max_tokens,
                            boundaries=job.prompt.boundaries, should_stop=job._cancel.is_set,
                            namespace=job.namespace, turn=self.turn)

    def _step(self) -> bool:
        """One step of the Engine; True when the job is done."""
        if self.steps is None:
            if self.job.cancelled:
                self.finish = "cancelled"
                return True
            self.steps = self._begin()
        token = next(self.steps, -1)
        if token is None:          # a prefill pass
            return False
        if token == -1:            # the generator ended (max_tokens, or should_stop)
            return True
        if token in self.eos:
            self.finish = "stop"
            return True
        self.n += 1
        self.text.add(token, self.tap.take(token) if self.tap else None)
        if self.text.stops.hit:
            self.finish = "stop"
            return True
        return self.job.cancelled

    def _result(self) -> Finished:
        job = self.job
        if self.steps is None:     # cancelled before it started
            return Finished("cancelled", 0, 0)
        self.steps.close()  # the Engine commits what is in the KV state on any exit
        if job.cancelled:
            self.finish = "cancelled"
        else:
            self.text.finish()
        stats, n, finish = self.turn.stats, self.n, self.finish
        before = {**job.prompt.timings, "queue": job.queue_s}
        turn = observe_turn(stats, before, digest(self.loaded.engine.store, self.turn.entry))
        cached = stats.cached_tokens if stats else 0
        prefill_s = stats.lookup_s + stats.restore_s + stats.prefill_s if stats else 0.0
        decode_s = time.perf_counter() - self.t0 - prefill_s
        log.info("worker: prompt %d tokens (%d cached) in %.3fs; %d generated in %.3fs (%.1f/s); "
                 "finish %s", len(job.prompt.tokens), cached, prefill_s, n, decode_s,
                 n / decode_s if decode_s > 0 else 0.0, finish)
        return Finished(finish, n, cached, turn)


def observe_turn(stats: PromptStats | None, before: dict[str, float],
                 restorable: dict[str, Any] | None = None) -> dict[str, Any]:
    """Record the request's breakdown (metrics, DEBUG log) and return its JSON, with what the
    worker can restore of its tokens now (`restorable.py`)."""
    observe(stats, before)
    return breakdown(stats, before, restorable)


def _reset_random_state() -> None:
    """An exception inside mlx-lm's compiled sampler leaves MLX's global random state as a
    trace placeholder, and every later generation fails ("eval an array without a
    primitive"): give it a fresh key."""
    import mlx.core as mx

    mx.random.seed(time.time_ns() & 0xFFFFFFFF)
