"""The worker's single generation thread: the loaded model (`loading.py`), its Engine, and the
jobs it runs.

Owns: every mlx call of the worker process. Model loading, Engine construction, generation and
`Engine.cache_info()` all run on ONE thread (a ThreadPoolExecutor with one worker), so the
Engine and its checkpoint store need no locks. It runs `Job`s (`jobs.py`: a prompt in, events
out, a cancel flag polled between forward passes) as `active.Active`s: with max_active 1 one at
a time to its end (the executor's FIFO is the request queue); with more, one `schedule.drive`
loop on the same thread interleaves up to max_active of them a forward pass at a time (its
inbox is the queue; a `call`, a state export or import, runs between two of its passes). It
hands the disk tier the writes that fall due while no request runs. Nothing here speaks HTTP:
failures are `Failed` events or `WorkerClosed`, which `worker.py` and `respond.py` turn into
responses. A group worker's leader (`group.py`) journals every job it starts and every pass it
runs to its followers, which replay them (`follower.py`); a sampled request without a seed gets
one from the leader, so every rank draws the same tokens.
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
from typing import Any

from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.engine.loading import Loaded, load
from prefixd.backends.mlx.grammar.matcher import GrammarTokenizers
from prefixd.backends.mlx.group.leader import Leader
from prefixd.backends.mlx.group.lockstep import SOLO, Solo
from prefixd.backends.mlx.model.memory import mlx_memory
from prefixd.backends.mlx.scheduler.active import Active
from prefixd.backends.mlx.scheduler.jobs import Event, Failed, Finished, Job, WorkerClosed
from prefixd.backends.mlx.scheduler.replay import job_record
from prefixd.backends.mlx.scheduler.schedule import Schedule, drive, kv_bytes_per_token
from prefixd.backends.mlx.settings import WorkerSettings

log = logging.getLogger("prefixd.worker")


class Generator:
    """The model, its Engine and the one thread they live on."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.loaded: Loaded | None = None
        self.cache_info: dict[str, Any] = {}
        self.memory: dict[str, int] = {}  # MLX's allocator, read with cache_info (memory.py)
        self.stats = {"requests": 0, "cancelled": 0, "completion_tokens": 0}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixd-gen")
        self._pending: set[Job] = set()  # submitted and not finished; all cancelled on close
        self._lock = threading.Lock()    # max_active > 1: the scheduler's inbox
        self._inbox: list[Job] = []
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []  # for the drive loop
        self._driving = False            # a `_drive` loop is queued or running
        self._ticker: asyncio.Task[None] | None = None
        self.grammars = GrammarTokenizers()  # structured output's view of the tokenizer
        self.leader: Leader | None = None    # a group worker's rank 0 (settings.group_hosts)
        self.ranks: list[dict[str, Any]] = []  # its followers, as last asked (cache_info)
        self._ids = 0

    async def load(self, spec: str) -> Loaded:
        """Load the model and build the Engine on the generation thread; then keep submitting
        the disk writes that fall due while no request runs."""
        loop = asyncio.get_running_loop()
        loaded = await loop.run_in_executor(self._executor, self._load, spec)
        self._ticker = asyncio.create_task(self._write_ticker())
        return loaded

    async def _write_ticker(self) -> None:
        """Hand idle entries to the disk writer (on the generation thread: it makes array
        views, which take microseconds; the writer thread does the I/O)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(0.25)
            engine = self.loaded.engine if self.loaded else None
            due = engine.next_write_due() if engine else None
            if engine is None or due is None or due > time.monotonic():
                continue
            try:
                await loop.run_in_executor(self._executor, self._write_due)
            except RuntimeError:          # the executor is shut down
                return
            except Exception:
                log.exception("worker: submitting disk writes failed")

    async def persist(self, timeout: float) -> bool:
        """At shutdown: write everything the disk tier lacks, waiting at most `timeout` s."""
        if self._ticker is not None:
            self._ticker.cancel()
        if self.loaded is None:
            return True
        engine = self.loaded.engine
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()

        def run() -> bool:
            if self.leader is not None:     # every rank writes what it lacks, at once
                self.leader.send({"op": "persist", "timeout": timeout})
            engine.persist()
            done = engine.close(timeout)
            if self.leader is not None:
                done = all([done, *(a.get("done") for a in self.leader.answers(timeout + 5))])
            return done

        try:
            done = await loop.run_in_executor(self._executor, run)
        except RuntimeError:
            return False
        info = engine.cache_info().get("disk")
        if info:
            log.info("worker: disk cache %s at shutdown in %.2fs (%.1f MiB on disk)",
                     "written" if done else "NOT fully written", time.perf_counter() - t0,
                     info["bytes_used"] / 2**20)
        return done

    def load_blocking(self, spec: str) -> Loaded:
        """`load` for callers without an event loop (tests, benchmarks)."""
        return self._executor.submit(self._load, spec).result()

    def _load(self, spec: str) -> Loaded:
        agree: Solo = SOLO
        if len(self.settings.group_hosts) > 1:
            self.leader = Leader(self.settings.group_hosts, ["--model", spec])
            agree = self.leader.start()
        self.loaded = load(self.settings, spec, agree)
        self.cache_info = self.loaded.engine.cache_info()
        self.memory = mlx_memory()
        return self.loaded

    def submit(self, prompt: Prompt, sampling: Sampling, max_tokens: int,
               logprobs: int | None = None, namespace: str = "") -> Job:
        """Queue a generation; its events arrive through `job.events()` in order."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                job.cancel()

        if self.leader is not None and sampling.temperature > 0 and sampling.seed is None:
            sampling = replace(sampling, seed=secrets.randbits(63))   # the same on every rank
        self._ids += 1
        job = Job(prompt, sampling, max_tokens, logprobs, emit, queue, namespace=namespace,
                  id=self._ids)
        self._pending.add(job)
        try:
            if self.settings.max_active == 1:
                self._executor.submit(self._run, job)
            else:
                with self._lock:
                    self._inbox.append(job)
                    idle, self._driving = not self._driving, True
                if idle:
                    self._executor.submit(self._drive)
        except RuntimeError:  # the executor is shut down
            raise WorkerClosed("the worker is shutting down") from None
        return job

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` on the generation thread, in turn with the jobs (a state export or
        import: `bundle.py`); then the cache summary is refreshed."""
        assert self.loaded is not None
        engine = self.loaded.engine

        def run() -> Any:
            try:
                return fn(engine)
            finally:
                self.cache_info = engine.cache_info()

        between: Future[Any] = Future()
        with self._lock:           # a drive loop under way runs it between two passes
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

    def cancel_all(self) -> None:
        """Cancel the running job and every queued one (each still gets its last event)."""
        for job in list(self._pending):
            job.cancel()

    def _run(self, job: Job) -> None:
        """One job to its end, on the generation thread (max_active 1: the executor's FIFO
        is the queue)."""
        job.queue_s = time.perf_counter() - job.submitted
        active = self._start(job, None, None)     # a job cancelled meanwhile ends at once
        while not active.advance():
            pass

    def _drive(self) -> None:
        """max_active > 1: run the submitted jobs a forward pass at a time (`schedule.py`)
        until none is left."""
        assert self.loaded is not None
        engine, s = self.loaded.engine, self.settings
        plan = Schedule(s.max_active, s.prefill_slice, s.prefill_chunk,
                        int(s.active_kv_share * engine.config.cache_bytes),
                        kv_bytes_per_token(engine.reference_leaves()), s.prefill_slice_ms,
                        engine.tiers.prefill_rate,
                        lambda job: engine.cached_now(job.prompt.tokens, job.namespace))
        drive(plan, self._take, self._start,
              lambda job: self._end(job, Finished("cancelled", 0, 0)), self._arrived)

    def _take(self, idle: bool) -> list[Job] | None:
        """The drive loop's inbox, between two passes: run the calls waiting, hand over the
        jobs submitted (None, and the loop ends, when it is idle and nothing came)."""
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
        """The jobs submitted since the drive loop last looked, during a pass (its calls wait
        for the pass's end). Read first without the lock: a job that races it is seen at the
        next layer or the next pass."""
        if not self._inbox:
            return []
        with self._lock:
            jobs, self._inbox = self._inbox, []
        return jobs

    def _start(self, job: Job, slicer: Callable[[], int] | None,
               preempt: Callable[[], bool] | None) -> Active:
        assert self.loaded is not None
        journal = self.leader.send if self.leader is not None else None
        if journal is not None:
            journal(job_record(job))
        return Active(self.loaded, self.grammars, job, slicer, self._end, journal, preempt)

    def _end(self, job: Job, result: Event) -> None:
        """Always the end of a job's events (`Finished` or `Failed`), so no handler waits
        forever. Never raises."""
        if self.leader is not None and isinstance(result, Failed) and "[ring]" in result.message:
            self.leader.fail(f"a forward pass lost its peers ({result.message})")
        self._pending.discard(job)
        self._after(result)
        job._emit(result)  # last, so a client that saw the end also sees fresh cache_info

    def _after(self, result: Event) -> None:
        if isinstance(result, Finished):
            self.stats["requests"] += 1
            self.stats["cancelled"] += result.finish_reason == "cancelled"
            self.stats["completion_tokens"] += result.completion_tokens
        try:
            if self.loaded is not None:
                engine = self.loaded.engine
                due = engine.next_write_due()
                if due is not None and due <= time.monotonic():
                    self._write_due()
                self.cache_info = engine.cache_info()
                self.memory = mlx_memory()
                if self.leader is not None:
                    self.ranks = [{**rank, **answer} for rank, answer in zip(
                        self.leader.ranks(), self.leader.ask({"op": "info"}), strict=True)]
        except Exception:
            log.exception("worker: Engine.cache_info() failed")

    def _write_due(self) -> int:
        """Hand the disk writer the entries due (on the generation thread); a group's leader
        journals which, so every rank writes the same entries of its own layers."""
        assert self.loaded is not None
        engine = self.loaded.engine
        positions = engine.due_writes()
        if positions and self.leader is not None:
            self.leader.send({"op": "write", "entries": positions})
        return engine.write(positions) if positions else 0

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
        if self.leader is not None:
            self.leader.close()
        if self._ticker is not None:
            self._ticker.cancel()
        if self.loaded is not None:  # stop the disk writer without waiting (persist waits)
            self._executor.submit(self.loaded.engine.close, 0.0)
        self._executor.shutdown(wait=False)
