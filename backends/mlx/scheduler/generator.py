"""The worker's generation loop: the loaded model (`engine/loading.py`), its Engine, and the
jobs it runs, all on one thread.

Owns: every mlx call of the worker process. Model loading, Engine construction, generation, state
moves and `Engine.cache_info()` all run on ONE thread (a ThreadPoolExecutor with one worker), so the
Engine and its checkpoint store need no locks. Jobs (`scheduler/jobs.py`: a prompt in, events out, a
cancel flag) are submitted to an inbox; one loop on that thread (`loop.drive`, for every
`max_active`) takes them between two passes, admits them and runs one forward pass at a time, each
job a `active.Active`. A `call` (a state export or import) runs between two passes too. Nothing here
speaks HTTP: failures are `Failed` events or `WorkerClosed`, which the server room turns into
responses.

It holds the lockstep (`group/lockstep.py`): one process's, or a group's leader's, which
journals every job this loop starts and every pass it runs to the followers (`replay.py`
replays them); a sampled request without a seed gets one here, so every rank draws the same
tokens. Disk writes (`writes.py`) and the status snapshot (`status.py`) are their own owners;
the loop only gives them their turn between two passes.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, cast

from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.engine.loading import Loaded, load
from prefixd.backends.mlx.events.announcer import Announcer
from prefixd.backends.mlx.events.announcer import start as start_announcer
from prefixd.backends.mlx.grammar.matcher import GrammarTokenizers
from prefixd.backends.mlx.group.leader import Leader
from prefixd.backends.mlx.group.lockstep import Lockstep
from prefixd.backends.mlx.scheduler import writes
from prefixd.backends.mlx.scheduler.active import Active, prefill_together, step_batch
from prefixd.backends.mlx.scheduler.jobs import Event, Failed, Finished, Job, Outbox, WorkerClosed
from prefixd.backends.mlx.scheduler.journal import JobEntry, encode
from prefixd.backends.mlx.scheduler.loop import drive
from prefixd.backends.mlx.scheduler.policy.schedule import Schedule
from prefixd.backends.mlx.scheduler.policy.slots import Task
from prefixd.backends.mlx.scheduler.policy.steps import Step
from prefixd.backends.mlx.scheduler.sizing import kv_bytes_per_token, request_bytes
from prefixd.backends.mlx.scheduler.status import Status
from prefixd.backends.mlx.settings import WorkerSettings

log = logging.getLogger("prefixd.worker")


class Generator:
    """The model, its Engine and the one thread they live on."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.loaded: Loaded | None = None
        self.status = Status()
        self.lockstep: Lockstep = Lockstep()  # a group's leader once loaded (group_hosts)
        self.grammars = GrammarTokenizers()   # structured output's view of the tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixd-gen")
        self._pending: set[Job] = set()  # submitted and not finished; all cancelled on close
        self._lock = threading.Lock()    # the loop's inbox
        self._inbox: list[Job] = []
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._driving = False            # a `_drive` loop is queued or running
        self._ticker: asyncio.Task[None] | None = None
        self._ids = 0
        self._outbox: Outbox | None = None   # the event loop's (the one jobs are submitted on)
        self.kv_topic = ""                    # the KV event stream's topic (set before load)
        self.announcer: Announcer | None = None   # with PREFIXD_KV_EVENTS

    @property
    def grouped(self) -> bool:
        """Whether this worker is a group's leader."""
        return self.lockstep.size > 1

    async def load(self, spec: str) -> Loaded:
        """Load the model and build the Engine on the generation thread; then keep handing
        the disk writer the writes that fall due while no job runs (`writes.py`)."""
        loop = asyncio.get_running_loop()
        loaded = await loop.run_in_executor(self._executor, self._load, spec)
        self._ticker = asyncio.create_task(writes.tick(
            loaded.engine, lambda: not self._driving,
            lambda fn: loop.run_in_executor(self._executor, fn), self.lockstep))
        return loaded

    def _load(self, spec: str) -> Loaded:
        if len(self.settings.group_hosts) > 1:
            self.lockstep = Leader(self.settings.group_hosts, ["--model", spec],
                                   self.settings.group_watchdog_s)
        self.loaded = load(self.settings, spec, self.lockstep)
        if self.settings.kv_events:
            self.announcer = start_announcer(self.settings, self.loaded.engine, spec,
                                             self.kv_topic)
        self.lockstep.arm()
        self.status.refresh(self.loaded.engine)
        # a group's Engine ran its reference pass on every rank; one process's runs it now
        self.status.kv_bytes_per_token = kv_bytes_per_token(
            self.loaded.engine.reference_leaves())
        return self.loaded

    async def persist(self, timeout: float) -> bool:
        """At shutdown: every rank writes everything its disk tier lacks, waiting at most
        `timeout` s."""
        if self._ticker is not None:
            self._ticker.cancel()
        if self.loaded is None:
            return True
        engine = self.loaded.engine
        t0 = time.perf_counter()

        def local(timeout: float) -> bool:
            engine.persist()
            return engine.close(timeout)

        try:
            done = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.lockstep.persist, local, timeout)
        except RuntimeError:
            return False
        info = engine.cache_info().get("disk")
        if info:
            log.info("worker: disk cache %s at shutdown in %.2fs (%.1f MiB on disk)",
                     "written" if done else "NOT fully written", time.perf_counter() - t0,
                     info["bytes_used"] / 2**20)
        return done

    def submit(self, prompt: Prompt, sampling: Sampling, max_tokens: int,
               logprobs: int | None = None, namespace: str = "") -> Job:
        """Queue a generation; its events arrive through `job.events()` in order."""
        loop = asyncio.get_running_loop()
        if self._outbox is None or self._outbox.loop is not loop:
            self._outbox = Outbox(loop)
        outbox = self._outbox
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            try:
                outbox.put(queue, event)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                job.cancel()

        if self.grouped and sampling.temperature > 0 and sampling.seed is None:
            sampling = replace(sampling, seed=secrets.randbits(63))   # the same on every rank
        self._ids += 1
        job = Job(prompt, sampling, max_tokens, logprobs, emit, queue, namespace=namespace,
                  id=self._ids)
        self._pending.add(job)
        with self._lock:
            self._inbox.append(job)
            idle, self._driving = not self._driving, True
        if idle:
            try:
                self._executor.submit(self._drive)
            except RuntimeError:  # the executor is shut down
                raise WorkerClosed("the worker is shutting down") from None
        return job

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` on the generation thread, between two passes (a state export or
        import: `engine/transfer/bundle.py`); then the status is refreshed."""
        assert self.loaded is not None
        engine = self.loaded.engine

        def run() -> Any:
            try:
                return fn(engine)
            finally:
                self.status.refresh(engine)
                self._observe()

        between: Future[Any] = Future()
        with self._lock:           # a loop under way runs it between two passes
            queued = self._driving
            if queued:
                self._calls.append((run, between))
        if queued:
            return await asyncio.wrap_future(between)
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor, run)
        except RuntimeError:  # the executor is shut down
            raise WorkerClosed("the worker is shutting down") from None
        return await future

    def jobs(self) -> tuple[int, int]:
        """(waiting, running): the jobs submitted and not admitted yet, and those admitted and
        not ended, as the loop last reported them (`status.Status.scheduled`); from any
        thread."""
        running = self.status.under_way.running
        return max(0, len(self._pending) - running), running

    def cancel_all(self) -> None:
        """Cancel the running job and every queued one (each still gets its last event)."""
        for job in list(self._pending):
            job.cancel()

    def _drive(self) -> None:
        """Run the submitted jobs a forward pass at a time (`scheduler/policy/schedule.py`)
        until none is left."""
        assert self.loaded is not None
        engine, s = self.loaded.engine, self.settings
        leaves, width = engine.reference_leaves(), engine.spec.max_draft + 1 if engine.spec else 1
        plan = Schedule(s.max_active, s.prefill_slice, s.prefill_chunk,
                        int(s.active_kv_share * engine.config.cache_bytes),
                        kv_bytes_per_token(leaves), s.prefill_slice_ms,
                        engine.tiers.prefill_rate,
                        lambda job: engine.cached_now(job.prompt.tokens, job.namespace),
                        width if engine.spec else 0,
                        request_bytes(leaves, engine.logits_bytes, width,
                                      bool(engine.spec and engine.spec.leaves),
                                      engine.batch.ahead.mode != "off"))
        batched = s.batch_decode and not engine.unbatchable
        def report(schedule: Schedule) -> None:
            self.status.scheduled(schedule)
            self._observe()

        drive(plan, self._take, self._start, self._end, self._arrived,
              self._batch if batched else None,
              self._prefill if batched and engine.prefills_together else None, report)

    def _observe(self) -> None:
        """Between two passes: the KV event stream learns of a change of the RAM store."""
        if self.announcer is not None and self.loaded is not None:
            self.announcer.observe(self.loaded.engine.store)

    def _batch(self, tasks: list[Task], stops: list[bool]) -> list[Step]:
        """Decode steps of several jobs in one pass (`active.step_batch`)."""
        return step_batch(cast(list[Active], tasks), stops)

    def _prefill(self, tasks: list[Task], stops: list[bool]) -> list[Step]:
        """The first steps of several jobs, their short prompts in one pass
        (`active.prefill_together`)."""
        return prefill_together(cast(list[Active], tasks), stops)

    def _take(self, idle: bool) -> list[Job] | None:
        """The loop's inbox, between two passes: run the calls waiting, hand over the jobs
        submitted (None, and the loop ends, when it is idle and nothing came)."""
        with self._lock:
            jobs, self._inbox = self._inbox, []
            calls, self._calls = self._calls, []
            if idle and not jobs and not calls:
                self._driving = False
                return None
        for run, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(run())
                except BaseException as e:  # the caller's to handle (as run_in_executor does)
                    future.set_exception(e)
        return jobs

    def _arrived(self) -> list[Job]:
        """The jobs submitted since the loop last took its inbox, peeked at during a pass
        (nothing is taken: admission waits for the pass's end or pause). Read first without
        the lock: a job that races it is seen at the next layer or the next pass."""
        if not self._inbox:
            return []
        with self._lock:
            return list(self._inbox)

    def _start(self, job: Job, preempt: Callable[[], bool] | None,
               regroup: Callable[[], int] | None = None) -> Active:
        assert self.loaded is not None
        self.lockstep.journal(encode(JobEntry.of(job)))
        return Active(self.loaded, self.grammars, job, self.lockstep, preempt, regroup)

    def _end(self, job: Job, result: Finished | Failed) -> None:
        """A job's last event, between two passes: the disk writes due and the status first,
        so a client that saw the end also sees fresh cache_info. Never raises."""
        self._pending.discard(job)
        self.status.ended(result)
        if self.loaded is not None:
            try:
                if writes.due(self.loaded.engine):
                    writes.hand_over(self.loaded.engine, self.lockstep)
            except Exception:
                log.exception("worker: submitting disk writes failed")
            self.status.refresh(self.loaded.engine)
            self._observe()
        job.emit(result)

    async def drain(self, timeout: float) -> bool:
        """Cancel every job and wait (at most `timeout` s) until the thread is idle. False if it
        is stuck in a call that cannot be interrupted (loading a model)."""
        self.cancel_all()
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(self._executor, lambda: None), timeout)
        except (TimeoutError, RuntimeError):  # RuntimeError: already shut down
            return False
        return True

    def close(self) -> None:
        self.cancel_all()
        self.lockstep.close()
        if self._ticker is not None:
            self._ticker.cancel()
        if self.announcer is not None:   # the model goes: AllBlocksCleared
            self.announcer.close()
        if self.loaded is not None:  # stop the disk writer without waiting (persist waits)
            self._executor.submit(self.loaded.engine.close, 0.0)
        self._executor.shutdown(wait=False)
