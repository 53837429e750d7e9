"""One job under way on the generation thread: its Engine steps, one forward pass per `step`,
and its output (text deltas, log-probabilities).

Owns: a job's sampler and grammar mask, its `engine.Turn` (its own stats and store entry, so
jobs under way together do not clobber each other), and its end (`Finished` with the per-turn
breakdown and the restorable digest, or `Failed`). The scheduler (`generator.py`) drives it
for every `max_active`; a group's followers replay it (`replay.py`). Each step runs on a
`Decision` taken before it (its prefill pass size and whether the job stops), journaled
through the lockstep first, so every rank of a group runs the same passes; and returns a
typed `Step`: `Prefilled` (a prefill pass ended), `Paused` (one stopped between two layers),
`Decoded` (a token sampled), or the job's end, `Finished` / `Failed`. A step never raises: a
failure is the lockstep's (one process: the job fails alone; a group: its work ends on every
rank and it restarts).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from typing import Any

from prefixd.backends.mlx.engine.engine import Turn
from prefixd.backends.mlx.engine.live.fed import Fed
from prefixd.backends.mlx.engine.loading import Loaded
from prefixd.backends.mlx.engine.pacing import (
    Pacing,
    Paused,
    Plan,
    Prefilled,
    Ready,
    Regrouped,
    Sent,
    resume,
)
from prefixd.backends.mlx.engine.restorable import digest
from prefixd.backends.mlx.engine.run import Run
from prefixd.backends.mlx.engine.run import Step as EngineStep
from prefixd.backends.mlx.engine.stats import PromptStats, breakdown, observe
from prefixd.backends.mlx.grammar.matcher import GrammarTokenizers, grammar_mask
from prefixd.backends.mlx.group.lockstep import Lockstep
from prefixd.backends.mlx.scheduler.jobs import Failed, Finished, Job
from prefixd.backends.mlx.scheduler.journal import (
    BatchEntry,
    PrefillEntry,
    PublishEntry,
    StepEntry,
    encode,
)
from prefixd.backends.mlx.scheduler.output import (
    LogprobTap,
    TextOut,
    sampling_functions,
    stop_strings,
)
from prefixd.backends.mlx.scheduler.policy.steps import Decision, Decoded, Step
from prefixd.metrics import worker as metrics

log = logging.getLogger("prefixd.worker")


class Active:
    """One job under way: its Engine steps (one forward pass per `step`) and its output.
    Nothing runs until the first step, which restores and runs the first prefill pass."""

    def __init__(self, loaded: Loaded, grammars: GrammarTokenizers, job: Job,
                 lockstep: Lockstep, preempt: Callable[[], bool] | None = None,
                 regroup: Callable[[], int] | None = None) -> None:
        self.loaded, self.grammars, self.job, self.lockstep = loaded, grammars, job, lockstep
        self.stopping = False
        # A group's ranks run whole passes in lockstep (their collectives in the same order):
        # only one process pauses a pass between two layers, or takes one back (`run.Run`).
        untimed = lockstep.untimed
        self.turn = Turn(Pacing(None if untimed else preempt, None if untimed else regroup))
        # its Engine steps, from its first step on (`Engine.steps_of`; begun before: `begin`)
        self.steps: Generator[EngineStep, Sent, None] | None = None
        self.n, self.finish, self.t0 = 0, "length", time.perf_counter()

    def remaining(self) -> int:
        run = self.turn.run
        return len(self.job.prompt.tokens) if run is None else len(run.prompt) - run.pos

    def length(self) -> int:
        """Tokens its live cache holds now."""
        run = self.turn.run
        return 0 if run is None else run.pos + len(run.fed)

    def pass_rate(self) -> float | None:
        """Tokens per second of its last prefill pass (None before its first)."""
        run = self.turn.run
        if run is None or not run.segments:
            return None
        tokens, seconds = run.segments[-1]
        return tokens / seconds if seconds > 0 else None

    def step(self, decision: Decision) -> Step:
        """One forward pass, or its part up to a pause, on `decision` (journaled first: a
        group's followers replay it): its plan goes in with the step. Never raises."""
        self.stopping = decision.stop
        self.lockstep.journal(encode(StepEntry(self.job.id, decision)))
        return self.advance(Plan(decision.tokens, decision.share, decision.pausable))

    def publish(self, at: int) -> int | None:
        """Store its prompt's state at `at` (its prefill is past it) from its live state, for
        jobs waiting for that prefix (journaled first: a group's followers store it too); the
        tokens stored (`Engine.publish_live`), None while a pass of it is half done."""
        run = self.turn.run
        if run is None or run.broken:
            return None
        self.lockstep.journal(encode(PublishEntry(self.job.id, at)))
        return self.loaded.engine.publish_live(run, self.turn.entry, at, self.job.namespace)

    def ready(self) -> bool:
        """Whether its prefill waits for its prompt's last token (`engine.pacing.Ready`): its
        next step can share a decode pass (`step_batch`)."""
        run = self.turn.run
        return run is not None and run.prompt_pending and not run.broken

    def begin(self) -> None:
        """Its turn begun, if not yet: sampling set up, its cache restored (`Engine.begin`);
        no pass runs. Raises what the restore raises."""
        if self.turn.run is None and not self.stopping:
            self._begin()

    def unstarted(self) -> bool:
        """Whether it began and no pass of it ran yet, nor is half done (one taken back,
        `Regrouped`, counts as none): its prompt past what it restored can share a prefill
        pass with others' (`prefill_together`)."""
        run = self.turn.run
        return run is not None and run.pos == run.start and not run.fed and not run.broken

    def feeding(self) -> Run | None:
        """Its run, when its next step feeds the token it sampled last (a decode step that
        can share a pass: `step_batch`)."""
        run = self.turn.run
        return run if run is not None and self.steps is not None and run.wants_feed() else None

    def advance(self, sent: Plan | Fed | None = None) -> Step:
        """Its next step, resumed with `sent` (`pacing.Sent`: its plan, or what a decode
        batch's pass that fed it left for it, from which it samples its next token). Never
        raises."""
        try:
            step = self._step(sent)
            return step if step is not None else self._result()
        except Exception as e:
            return self.fail(e)

    def fail(self, e: BaseException) -> Failed:
        """It fails on `e` (a group's work ends on every rank: no return)."""
        log.exception("worker: generation failed", exc_info=e)
        why = f"{type(e).__name__}: {e}"
        self.lockstep.failed(why)
        self._end()
        _reset_random_state()
        self._let_go()
        return Failed(f"generation failed: {why}")

    def _end(self) -> None:
        """Its steps over (ended, or closed here) and its turn ended: what its live cache
        holds committed, its arrays let go (`Engine.end`: once; never raises)."""
        if self.steps is not None:
            self.steps.close()
        if self.turn.run is not None:
            self.loaded.engine.end(self.turn)

    def _begin(self) -> None:
        engine, tokenizer, job = self.loaded.engine, self.loaded.tokenizer, self.job
        s, fmt = job.sampling, self.loaded.renderer.tool_format()
        mask = None if s.constraint is None else grammar_mask(
            s.constraint, self.grammars, tokenizer, fmt, job.prompt.thinking)
        sampler, processors = sampling_functions(s, len(tokenizer), mask)
        self.tap = None if job.logprobs is None else LogprobTap(sampler, job.logprobs, tokenizer)
        stops, until = stop_strings(s, fmt)
        self.text = TextOut(job.emit, stops, tokenizer.detokenizer, until)
        self.eos = tokenizer.eos_token_ids
        engine.begin(job.prompt.tokens, sampler=self.tap or sampler,
                     logits_processors=processors or None, max_tokens=job.max_tokens,
                     should_stop=self._stopping, namespace=job.namespace, turn=self.turn)

    def _stopping(self) -> bool:
        return self.stopping

    def _step(self, sent: Sent) -> Prefilled | Ready | Paused | Decoded | None:
        """One step of the Engine, resumed with `sent`; None when the job is done."""
        if self.steps is None:
            if self.turn.run is None:
                if self.stopping:
                    self.finish = "cancelled"
                    return None
                self._begin()
            self.steps = self.loaded.engine.steps_of(
                self.turn, self.job.prompt.boundaries,
                sent if isinstance(sent, Plan) else Plan(0))
            sent = None   # its first step runs on that plan
        while True:   # a decode step that verified a draft yields every token it accepted
            step, sent = resume(self.steps, sent), None
            if step is None:           # the generator ended (max_tokens, or should_stop)
                return None
            if isinstance(step, Prefilled | Ready | Paused):
                return step
            if step in self.eos:
                self.finish = "stop"
                return None
            self.n += 1
            stops, run = self.text.stops, self.turn.run
            self.text.add(step, self.tap.take(step) if self.tap else None)
            if run is not None and stops.began_here:
                run.mark_stop()      # the text from this token on may be a stop string
            elif run is not None and not stops.holding and not stops.hit:
                run.stop_mark = None
            # else held since an earlier token: its mark stands (or none: nothing kept)
            if stops.hit:
                if run is not None:    # stored up to the stop string, where it can be
                    run.end_at_stop(self.text.stop_token())
                self.finish = "stop"
                return None
            if self.stopping:
                return None
            if run is None or not run.ahead:
                return Decoded(self.n)

    def _result(self) -> Finished:
        job = self.job
        if self.steps is None:     # cancelled before it started
            return Finished("cancelled", 0, 0)
        self._end()
        if self.stopping:
            self.finish = "cancelled"
        else:
            self.text.finish()
            if self.text.stops.hit:    # a stop string held back to the end ended the text
                self.finish = "stop"
        stats, n, finish = self.turn.stats, self.n, self.finish
        before = {**job.prompt.timings, "queue": job.queue_s, "paused": job.paused_s}
        turn = observe_turn(stats, before, digest(self.loaded.engine.store, self.turn.entry))
        cached = stats.cached_tokens if stats else 0
        prefill_s = stats.lookup_s + stats.restore_s + stats.prefill_s if stats else 0.0
        decode_s = time.perf_counter() - self.t0 - prefill_s
        run = self.turn.run
        batch = run.batched / len(run.fed) if run is not None and run.fed else 1.0
        metrics.BATCH_WAIT.observe(job.queue_s)
        spec = stats.speculative if stats else None
        drafts = (f"; drafted {spec['drafted']}, accepted {spec['accepted']} in "
                  f"{spec['passes']} verify passes" if spec else "")
        log.info("worker: prompt %d tokens (%d cached) in %.3fs; %d generated in %.3fs (%.1f/s, "
                 "decode batch %.1f%s); waited %.3fs for a slot; finish %s",
                 len(job.prompt.tokens), cached, prefill_s, n, decode_s,
                 n / decode_s if decode_s > 0 else 0.0, batch, drafts, job.queue_s, finish)
        self._let_go()
        return Finished(finish, n, cached, turn,
                        self.text.stops.matched if self.text.stops.hit else None)

    def _let_go(self) -> None:
        """Drop its store entry once it has ended (its run let go of its arrays already,
        `Run.release`): a finished job's objects refer to one another (its scheduler slot, its
        pacing, its run's stop check), so what they reach waits for Python's cycle collector,
        which seldom runs in a worker; an entry the store has since evicted or merged would
        hold its whole KV there (measured: ~12 MiB a request on the built-in model)."""
        self.turn.entry = None


def step_batch(actives: list[Active], stops: list[bool]) -> list[Step]:
    """One decode step of every job in `actives` (journaled first, as one entry), their
    pending tokens fed in one forward pass (`engine/batch/executor.py`); then each samples its own
    next token. `stops`: each job's `Decision.stop` (a stopping job is not fed; it ends). Never
    raises: a failed pass fails every job it fed."""
    lockstep = actives[0].lockstep
    lockstep.journal(encode(BatchEntry([a.job.id for a in actives], list(stops))))
    for a, stop in zip(actives, stops, strict=True):
        a.stopping = stop
    fed = [(a, run) for a in actives if (run := a.feeding()) is not None]
    left: dict[int, Fed] = {}
    if len(fed) > 1:
        try:
            got = actives[0].loaded.engine.batch.step([run for _, run in fed])
        except Exception as e:
            failed = {id(a) for a, _ in fed}
            return [a.fail(e) if id(a) in failed else a.advance() for a in actives]
        left = {id(a): f for (a, _), f in zip(fed, got, strict=True)}
    return [a.advance(left.get(id(a))) for a in actives]


def prefill_together(actives: list[Active], stops: list[bool]) -> list[Step]:
    """The first step of every job in `actives` (journaled first, as one entry): each begins
    (its cache restored), their prompts past what each restored prefill all but their last
    token in one pass (`Engine.prefill_together`: those its cache kind allows), the others
    their first pass alone; each is then `Ready` (its last token waits for a decode pass),
    or, where the shared pass was taken back for jobs that arrived during it, `Regrouped`
    (the scheduler plans them again, with those). `stops`: each job's `Decision.stop`.
    Never raises: a failed pass fails every job it fed."""
    lockstep = actives[0].lockstep
    lockstep.journal(encode(PrefillEntry([a.job.id for a in actives], list(stops))))
    out: dict[int, Step] = {}
    for a, stop in zip(actives, stops, strict=True):
        a.stopping = stop
        try:
            a.begin()
        except Exception as e:
            out[id(a)] = a.fail(e)
    rows = [a for a in actives if id(a) not in out and not a.stopping and a.unstarted()]
    if len(rows) > 1:
        try:
            if actives[0].loaded.engine.prefill_together(
                    [a.turn.run for a in rows if a.turn.run is not None],
                    actives[0].turn.pacing.regroup) is None:   # taken back: planned again
                out.update({id(a): Regrouped(0, 0) for a in rows})
        except Exception as e:
            out.update({id(a): a.fail(e) for a in rows})
    return [out[id(a)] if id(a) in out else a.advance() for a in actives]


def observe_turn(stats: PromptStats | None, before: dict[str, float],
                 restorable: dict[str, Any] | None = None) -> dict[str, Any]:
    """Record the request's breakdown (metrics, DEBUG log) and return its JSON, with what the
    worker can restore of its tokens now (`engine/restorable.py`)."""
    observe(stats, before)
    return breakdown(stats, before, restorable)


def _reset_random_state() -> None:
    """An exception inside mlx-lm's compiled sampler leaves MLX's global random state as a
    trace placeholder, and every later generation fails ("eval an array without a
    primitive"): give it a fresh key."""
    import mlx.core as mx

    mx.random.seed(time.time_ns() & 0xFFFFFFFF)
