"""The worker's single generation thread: the loaded model (`loading.py`), its Engine, and one
job at a time.

Owns: every mlx call of the worker process. Model loading, Engine construction, generation and
`Engine.cache_info()` all run on ONE thread (a ThreadPoolExecutor with one worker), so the
Engine and its checkpoint store need no locks, and the executor's FIFO is the request queue.
It runs `Job`s (`jobs.py`: a prompt in, events out, a cancel flag polled between decode
steps) and hands the disk tier the writes that fall due while no request runs. Nothing here
speaks HTTP: failures are `Failed` events or `WorkerClosed`, which `worker.py` and
`respond.py` turn into responses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefixd.backends.mlx.chat import Sampling
from prefixd.backends.mlx.grammar_run import GrammarTokenizers, grammar_mask
from prefixd.backends.mlx.jobs import Event, Failed, Finished, Job, WorkerClosed
from prefixd.backends.mlx.loading import Loaded, load
from prefixd.backends.mlx.memory import mlx_memory
from prefixd.backends.mlx.output import LogprobTap, TextOut, sampling_functions
from prefixd.backends.mlx.prompt import Prompt
from prefixd.backends.mlx.restorable import digest
from prefixd.backends.mlx.settings import WorkerSettings
from prefixd.backends.mlx.stats import PromptStats, breakdown, observe

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
        self._ticker: asyncio.Task[None] | None = None
        self.grammars = GrammarTokenizers()  # structured output's view of the tokenizer

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
                await loop.run_in_executor(self._executor, engine.write_due)
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
            engine.persist()
            return engine.close(timeout)

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
        self.loaded = load(self.settings, spec)
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

        job = Job(prompt, sampling, max_tokens, logprobs, emit, queue, namespace=namespace)
        self._pending.add(job)
        try:
            self._executor.submit(self._run, job)
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
        """One job, on the generation thread. Never raises, and always ends the job's events
        (with `Finished` or `Failed`), so no handler waits forever."""
        result: Event = Failed("generation failed")
        job.queue_s = time.perf_counter() - job.submitted
        try:
            result = Finished("cancelled", 0, 0) if job.cancelled else self._generate(job)
        except Exception as e:
            log.exception("worker: generation failed")
            result = Failed(f"generation failed: {type(e).__name__}: {e}")
            _reset_random_state()
        finally:
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
                    engine.write_due()
                self.cache_info = engine.cache_info()
                self.memory = mlx_memory()
        except Exception:
            log.exception("worker: Engine.cache_info() failed")

    def _generate(self, job: Job) -> Finished:
        import mlx.core as mx

        assert self.loaded is not None
        engine, tokenizer = self.loaded.engine, self.loaded.tokenizer
        s = job.sampling
        if s.seed is not None:
            mx.random.seed(s.seed)
        mask = None if s.constraint is None else grammar_mask(
            s.constraint, self.grammars, tokenizer, self.loaded.renderer.tool_format(),
            job.prompt.tokens)
        sampler, processors = sampling_functions(s, len(tokenizer), mask)
        tap = None if job.logprobs is None else LogprobTap(sampler, job.logprobs, tokenizer)
        text = TextOut(job._emit, s.stop, tokenizer.detokenizer)
        eos = tokenizer.eos_token_ids
        n, finish, t0 = 0, "length", time.perf_counter()
        tokens = engine.generate(job.prompt.tokens, sampler=tap or sampler,
                                 logits_processors=processors or None,
                                 max_tokens=job.max_tokens, boundaries=job.prompt.boundaries,
                                 should_stop=job._cancel.is_set, namespace=job.namespace)
        try:
            for token in tokens:
                if token in eos:
                    finish = "stop"
                    break
                n += 1
                text.add(token, tap.take(token) if tap else None)
                if text.stops.hit:
                    finish = "stop"
                    break
                if job.cancelled:
                    break
        finally:
            tokens.close()  # the Engine commits what is in the KV state on any exit
        if job.cancelled:
            finish = "cancelled"
        else:
            text.finish()
        stats = engine.last_stats
        before = {**job.prompt.timings, "queue": job.queue_s}
        turn = observe_turn(stats, before, digest(engine.store))
        cached = stats.cached_tokens if stats else 0
        prefill_s = stats.lookup_s + stats.restore_s + stats.prefill_s if stats else 0.0
        decode_s = time.perf_counter() - t0 - prefill_s
        log.info("worker: prompt %d tokens (%d cached) in %.3fs; %d generated in %.3fs (%.1f/s); "
                 "finish %s", len(job.prompt.tokens), cached, prefill_s, n, decode_s,
                 n / decode_s if decode_s > 0 else 0.0, finish)
        return Finished(finish, n, cached, turn)

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
        if self._ticker is not None:
            self._ticker.cancel()
        if self.loaded is not None:  # stop the disk writer without waiting (persist waits)
            self._executor.submit(self.loaded.engine.close, 0.0)
        self._executor.shutdown(wait=False)


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
