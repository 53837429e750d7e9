"""A follower rank of a group worker: no HTTP, no decisions, the generation loop's copy. It
proves itself to its leader, joins the ring with the other ranks, loads its shard of the model
with the same Engine, then replays the leader's journal in order, read through its lockstep
(`group/follower.py`: numbered entries, heartbeats): each job as the leader started it, each
step with the leader's `Decision`, so its forward passes, checkpoints, restores and evictions
are the leader's on its own layers (the values only a rank knows are agreed inside the Engine).
Replies and text are computed and dropped.

Owns: the follower's jobs under way (by the leader's job id) and the journal's two ends
(`job_record` / `job_from`). Ends when the leader says so or its channel closes (exit 0), or
on any failure (exit 3: the leader then stops the group, which restarts as one).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import replace
from typing import Any

from prefixd.api.structured import Constraint
from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.engine.loading import Loaded, load
from prefixd.backends.mlx.grammar.matcher import GrammarTokenizers
from prefixd.backends.mlx.group.control import connect
from prefixd.backends.mlx.group.follower import Follower
from prefixd.backends.mlx.group.lockstep import LockstepError
from prefixd.backends.mlx.group.start import CONTROL_ENV, JOIN_TIMEOUT_S, RANK_ENV, SECRET_ENV
from prefixd.backends.mlx.model.memory import memory_info, mlx_memory
from prefixd.backends.mlx.scheduler.active import Active, step_batch
from prefixd.backends.mlx.scheduler.jobs import Job
from prefixd.backends.mlx.scheduler.steps import Decision, Failed, Finished
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
    engine, grammars = loaded.engine, GrammarTokenizers()
    jobs: dict[int, Active] = {}
    lockstep.status = lambda: {"memory": memory_info(mlx_memory()),
                               "cache_bytes": engine.store.bytes_used, "jobs": len(jobs)}
    lockstep.beat()
    while True:
        entry = lockstep.next()
        op = entry.get("op")
        if op == "exit":
            return
        if op == "job":
            job = job_from(entry)
            jobs[job.id] = Active(loaded, grammars, job, lockstep)
        elif op == "step":
            decision = Decision(int(entry["tokens"]), bool(entry["stop"]),
                                int(entry.get("share", 0)))
            if isinstance(jobs[entry["job"]].step(decision), Finished | Failed):
                del jobs[entry["job"]]
        elif op == "batch":             # decode steps of several jobs in one pass
            ids = [int(i) for i in entry["jobs"]]
            for i, step in zip(ids, step_batch([jobs[i] for i in ids],
                                               [bool(x) for x in entry["stop"]]), strict=True):
                if isinstance(step, Finished | Failed):
                    del jobs[i]
        elif op == "publish":           # a prefix others wait for, from a job's live state
            jobs[int(entry["job"])].publish(int(entry["at"]))
        elif op == "write":             # the entries the leader hands its disk writer
            engine.write([int(i) for i in entry["entries"]])
        elif op == "persist":           # at shutdown: what this rank's disk tier lacks
            engine.persist()
            lockstep.answer({"done": engine.close(float(entry["timeout"]))})
        else:
            raise LockstepError(f"unknown journal entry {op!r}")


def job_record(job: Job) -> dict[str, Any]:
    """What a follower needs to run `job` exactly as the leader does (the journal's `job`)."""
    s = job.sampling
    sampling = {**s.__dict__, "stop": list(s.stop),
                "logit_bias": None if s.logit_bias is None else list(s.logit_bias.items()),
                "constraint": None if s.constraint is None else {
                    **s.constraint.__dict__, "tools": [list(t) for t in s.constraint.tools]}}
    return {"op": "job", "id": job.id, "tokens": job.prompt.tokens,
            "boundaries": job.prompt.boundaries, "thinking": job.prompt.thinking,
            "max_tokens": job.max_tokens,
            "logprobs": job.logprobs, "namespace": job.namespace, "sampling": sampling}


def job_from(record: dict[str, Any]) -> Job:
    """`job_record` back into a Job (its events go nowhere)."""
    raw = dict(record["sampling"])
    constraint = raw.pop("constraint")
    bias = raw.pop("logit_bias")
    sampling = replace(Sampling(), **{**raw, "stop": tuple(raw["stop"])},
                       logit_bias=None if bias is None else {int(k): v for k, v in bias},
                       constraint=None if constraint is None else Constraint(
                           **{**constraint, "tools": tuple((n, p) for n, p in
                                                           constraint["tools"])}))
    prompt = Prompt(list(record["tokens"]), list(record["boundaries"]),
                    thinking=bool(record["thinking"]))
    return Job(prompt, sampling,
               int(record["max_tokens"]), record["logprobs"], lambda event: None,
               asyncio.Queue(), namespace=str(record["namespace"]), id=int(record["id"]))
