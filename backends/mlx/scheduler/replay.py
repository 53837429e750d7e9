"""A follower rank of a group worker: no HTTP, no decisions, the generation loop's copy. It
proves itself to its leader, joins the ring with the other ranks, loads its shard of the model
with the same Engine, then replays the leader's journal in order, read through its lockstep
(`group/follower.py`: numbered entries, heartbeats), each decoded into its typed record
(`journal.py`): each job as the leader started it, each step on the leader's `Decision` (its
pass size, stop, share and pausable alike), so its forward passes, checkpoints, restores and
evictions are the leader's on its own layers (the values only a rank knows are agreed inside
the Engine). Replies and text are computed and dropped.

Owns: the follower's jobs under way (by the leader's job id) and what each record does to
them (`Replay.apply`, one exhaustive `match` over `journal.Record`: a record type without its
case fails the type check). Ends when the leader says so or its channel closes (exit 0), or
on any failure (exit 3: the leader then stops the group, which restarts as one).
"""

from __future__ import annotations

import logging
import os
import signal
from typing import assert_never

from prefixd.backends.mlx.engine.loading import Loaded, load
from prefixd.backends.mlx.grammar.matcher import GrammarTokenizers
from prefixd.backends.mlx.group.control import connect
from prefixd.backends.mlx.group.follower import Follower
from prefixd.backends.mlx.group.lockstep import LockstepError
from prefixd.backends.mlx.group.start import CONTROL_ENV, JOIN_TIMEOUT_S, RANK_ENV, SECRET_ENV
from prefixd.backends.mlx.model.memory import memory_info, mlx_memory
from prefixd.backends.mlx.scheduler.active import Active, prefill_together, step_batch
from prefixd.backends.mlx.scheduler.jobs import Job
from prefixd.backends.mlx.scheduler.journal import (
    BatchEntry,
    ExitEntry,
    JobEntry,
    PersistEntry,
    PrefillEntry,
    PublishEntry,
    Record,
    StepEntry,
    WriteEntry,
    decode,
)
from prefixd.backends.mlx.scheduler.policy.steps import Failed, Finished
from prefixd.backends.mlx.settings import WorkerSettings

log = logging.getLogger("prefixd.worker.group")


def is_follower() -> bool:
    return bool(os.environ.get(RANK_ENV))


def serve(settings: WorkerSettings, spec: str) -> int:
    """Run as a follower until the leader ends; the exit status."""
    from prefixd.backends.mlx.group.ring import follow

    rank = int(os.environ[RANK_ENV])
    # A stop is the leader's to order: SIGTERM/SIGINT sent to the whole group (systemd stopping
    # the daemon's control group, Ctrl-C in a terminal) reach this rank too, and acting on them
    # would end it before the leader had every rank persist. It ends on the leader's `exit`,
    # when the leader is gone (its channel closes), or by SIGKILL.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    try:
        channel = connect(os.environ[CONTROL_ENV], os.environ[SECRET_ENV], rank,
                          JOIN_TIMEOUT_S)
        lockstep = Follower(follow(channel, rank), channel, settings.group_watchdog_s)
        loaded = load(settings, spec, lockstep)
    except EOFError:
        log.info("worker: rank %d: the leader stopped the group while it joined", rank)
        return 0
    except Exception:
        log.exception("worker: rank %d could not join its group", rank)
        return 3
    log.info("worker: rank %d of %d ready", rank, lockstep.size)
    try:
        replay(loaded, lockstep)
    except EOFError:
        log.info("worker: rank %d: the leader is gone; exiting", rank)
        return 0
    except Exception:
        log.exception("worker: rank %d failed; the group restarts", rank)
        return 3
    finally:
        lockstep.close()
    return 0


def replay(loaded: Loaded, lockstep: Follower) -> None:
    """The journal, entry by entry, until the leader's `exit`."""
    follower = Replay(loaded, lockstep)
    lockstep.status = lambda: {"memory": memory_info(mlx_memory()),
                               "cache_bytes": loaded.engine.store.bytes_used,
                               "jobs": len(follower.jobs)}
    lockstep.beat()
    while follower.apply(decode(lockstep.next())):
        pass


class Replay:
    """A follower's jobs under way (by the leader's job id), each record of the journal
    applied to them as the leader took it."""

    def __init__(self, loaded: Loaded, lockstep: Follower) -> None:
        self.loaded, self.lockstep = loaded, lockstep
        self.grammars = GrammarTokenizers()
        self.jobs: dict[int, Active] = {}

    def start(self, job: Job) -> Active:
        return Active(self.loaded, self.grammars, job, self.lockstep)

    def apply(self, record: Record) -> bool:
        """Take `record` as the leader did; False once it says the group ends (`exit`)."""
        engine = self.loaded.engine
        match record:
            case JobEntry():
                self.jobs[record.id] = self.start(record.job())
            case StepEntry(job=job, decision=decision):
                if isinstance(self._job(job).step(decision), Finished | Failed):
                    del self.jobs[job]
            case BatchEntry(jobs=ids, stop=stops):   # decode steps of several jobs, one pass
                steps = step_batch([self._job(i) for i in ids], list(stops))
                for i, step in zip(ids, steps, strict=True):
                    if isinstance(step, Finished | Failed):
                        del self.jobs[i]
            case PrefillEntry(jobs=ids, stop=stops):   # short prompts prefilled in one pass
                steps = prefill_together([self._job(i) for i in ids], list(stops))
                for i, step in zip(ids, steps, strict=True):
                    if isinstance(step, Finished | Failed):
                        del self.jobs[i]
            case PublishEntry(job=job, at=at):   # a prefix others wait for, from a live run
                self._job(job).publish(at)
            case WriteEntry(entries=entries):    # the entries the leader hands its writer
                engine.write(list(entries))
            case PersistEntry(timeout=timeout):  # at shutdown: what this rank's disk lacks
                engine.persist()
                self.lockstep.answer({"done": engine.close(timeout)})
            case ExitEntry():
                return False
            case _:
                assert_never(record)
        return True

    def _job(self, job: int) -> Active:
        try:
            return self.jobs[job]
        except KeyError:
            raise LockstepError(f"the journal names job {job}, not under way here") from None
