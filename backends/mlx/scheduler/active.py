"""One job under way on the generation thread: its Engine steps, one forward pass per
`advance`, and its output (text deltas, log-probabilities, the last event).

Owns: a job's sampler and grammar mask, its `engine.Turn` (its own stats and store entry, so
jobs under way together do not clobber each other), its end (`Finished` with the per-turn
breakdown and the restorable digest, or `Failed`). Driven to its end at once (max_active 1,
`generation.Generator._run`) or a pass at a time among others (`schedule.drive`); the same
code either way. Each pass runs on two decisions taken before it (`step`): its prefill size
and whether the job stops; a group worker's leader sends them to its followers (`journal`),
whose copy of the job replays them (`follower.py`), so every rank runs the same passes.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Generator
from typing import Any

from prefixd.backends.mlx.engine.engine import Turn
from prefixd.backends.mlx.engine.loading import Loaded
from prefixd.backends.mlx.engine.restorable import digest
from prefixd.backends.mlx.engine.stats import PromptStats, breakdown, observe
from prefixd.backends.mlx.grammar.matcher import GrammarTokenizers, grammar_mask
from prefixd.backends.mlx.scheduler.jobs import Event, Failed, Finished, Job
from prefixd.backends.mlx.scheduler.output import LogprobTap, TextOut, sampling_functions

log = logging.getLogger("prefixd.worker")


class Active:
    """One job under way: its Engine steps (one forward pass per `advance`) and its output.
    Nothing runs until the first `advance`, which restores and runs the first prefill pass."""

    def __init__(self, loaded: Loaded, grammars: GrammarTokenizers, job: Job,
                 slicer: Callable[[], int] | None, end: Callable[[Job, Event], None],
                 journal: Callable[[dict[str, Any]], None] | None = None,
                 preempt: Callable[[], bool] | None = None) -> None:
        self.loaded, self.grammars, self.job, self._end = loaded, grammars, job, end
        self.slicer, self.journal = slicer, journal
        self.pass_tokens, self.stopping = sys.maxsize, False   # this pass's decisions
        # A group's ranks run whole passes in lockstep (their collectives in the same order):
        # only one process pauses a pass between two layers (`run.Run`).
        self.turn = Turn(lambda: self.pass_tokens, None if journal else preempt)
        self.steps: Generator[int | None, None, None] | None = None
        self.n, self.finish, self.t0 = 0, "length", time.perf_counter()

    def remaining(self) -> int:
        run = self.turn.run
        return len(self.job.prompt.tokens) if run is None else len(run.prompt) - run.pos

    def pass_rate(self) -> float | None:
        """Tokens per second of its last prefill pass (None before its first)."""
        run = self.turn.run
        if run is None or not run.segments:
            return None
        tokens, seconds = run.segments[-1]
        return tokens / seconds if seconds > 0 else None

    def midpass(self) -> bool:
        """Whether its last `advance` left a prefill pass paused between two layers."""
        return self.turn.run is not None and self.turn.run.midpass

    def advance(self) -> bool:
        """One forward pass, or its part up to a pause (`midpass`); True once the job has
        ended (its last event sent). Never raises: a failure ends the job with `Failed`."""
        return self.step(self.slicer() if self.slicer else sys.maxsize, self.job.cancelled)

    def step(self, tokens: int, stop: bool) -> bool:
        """`advance` with its decisions given: a prefill pass of at most `tokens`, and whether
        the job stops (its client left) before it. Journaled first (a group's followers
        replay them)."""
        self.pass_tokens, self.stopping = tokens, stop
        if self.journal is not None:
            self.journal({"op": "step", "job": self.job.id, "tokens": tokens, "stop": stop})
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
        engine, tokenizer, job = self.loaded.engine, self.loaded.tokenizer, self.job
        s = job.sampling
        mask = None if s.constraint is None else grammar_mask(
            s.constraint, self.grammars, tokenizer, self.loaded.renderer.tool_format(),
            job.prompt.tokens)
        sampler, processors = sampling_functions(s, len(tokenizer), mask)
        self.tap = None if job.logprobs is None else LogprobTap(sampler, job.logprobs, tokenizer)
        self.text = TextOut(job._emit, s.stop, tokenizer.detokenizer)
        self.eos = tokenizer.eos_token_ids
        return engine.steps(job.prompt.tokens, sampler=self.tap or sampler,
                            logits_processors=processors or None, max_tokens=job.max_tokens,
                            boundaries=job.prompt.boundaries, should_stop=self._stopping,
                            namespace=job.namespace, turn=self.turn)

    def _stopping(self) -> bool:
        return self.stopping

    def _step(self) -> bool:
        """One step of the Engine; True when the job is done."""
        if self.steps is None:
            if self.stopping:
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
        return self.stopping

    def _result(self) -> Finished:
        job = self.job
        if self.steps is None:     # cancelled before it started
            return Finished("cancelled", 0, 0)
        self.steps.close()  # the Engine commits what is in the KV state on any exit
        if self.stopping:
            self.finish = "cancelled"
        else:
            self.text.finish()
        stats, n, finish = self.turn.stats, self.n, self.finish
        before = {**job.prompt.timings, "queue": job.queue_s, "paused": job.paused_s}
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
