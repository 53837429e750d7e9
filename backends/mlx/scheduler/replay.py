"""A follower rank of a group worker (`group.py`): no HTTP, no decisions. It proves itself to
its leader, joins the ring with the other ranks, loads its shard of the model with the same
Engine, then replays the leader's journal in order: each job as the leader started it, each
pass with the leader's decisions (its prefill size, whether the job stops), so its forward
passes, checkpoints, restores and evictions are the leader's on its own layers (the values
only a rank knows are agreed inside the Engine, `agree.py`). Replies and text are computed
and dropped.

Owns: the follower's jobs under way (by the leader's job id) and its answers to the leader's
questions (`info`: its memory and cache). Ends when the leader says so, when its channel
closes (exit 0), or on any failure (exit 3: the leader then stops the group).
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
from prefixd.backends.mlx.group.control import Channel, connect
from prefixd.backends.mlx.group.leader import CONTROL_ENV, JOIN_TIMEOUT_S, RANK_ENV, SECRET_ENV
from prefixd.backends.mlx.model.memory import memory_info, mlx_memory
from prefixd.backends.mlx.scheduler.active import Active
from prefixd.backends.mlx.scheduler.jobs import Event, Job
from prefixd.backends.mlx.settings import WorkerSettings

log = logging.getLogger("prefixd.worker.group")


def is_follower() -> bool:
    return bool(os.environ.get(RANK_ENV))


def serve(settings: WorkerSettings, spec: str) -> int:
    """Run as a follower until the leader ends; the exit status."""
    from prefixd.backends.mlx.group.lockstep import Ring
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
        group = follow(channel, rank)
        loaded = load(settings, spec, Ring(group))
    except EOFError:
        log.info("worker: rank %d: the leader stopped the group while it joined", rank)
        return 0
    except Exception:
        log.exception("worker: rank %d could not join its group", rank)
        return 3
    log.info("worker: rank %d of %d ready", rank, group.size())
    try:
        Follower(loaded, channel).run()
    except EOFError:
        log.info("worker: rank %d: the leader is gone; exiting", rank)
        return 0
    except Exception:
        log.exception("worker: rank %d failed", rank)
        return 3
    return 0


class Follower:
    """The journal's replay: jobs by id, each advanced a pass per `step`."""

    def __init__(self, loaded: Loaded, channel: Channel) -> None:
        self.loaded, self.channel = loaded, channel
        self.grammars = GrammarTokenizers()
        self.jobs: dict[int, Active] = {}

    def run(self) -> None:
        while True:
            message = self.channel.recv(timeout=None)
            op = message.get("op")
            if op == "exit":
                return
            if op == "job":
                job = job_from(message)
                self.jobs[job.id] = Active(self.loaded, self.grammars, job, None, _dropped)
            elif op == "step":
                active = self.jobs[message["job"]]
                if active.step(int(message["tokens"]), bool(message["stop"])):
                    del self.jobs[message["job"]]
            elif op == "write":             # the entries the leader hands its disk writer
                self.loaded.engine.write([int(i) for i in message["entries"]])
            elif op == "persist":           # at shutdown: what this rank's disk tier lacks
                engine = self.loaded.engine
                engine.persist()
                self.channel.send({"done": engine.close(float(message["timeout"]))})
            elif op == "info":
                engine = self.loaded.engine
                self.channel.send({"memory": memory_info(mlx_memory()),
                                   "cache_bytes": engine.store.bytes_used,
                                   "jobs": len(self.jobs)})
            else:
                raise ValueError(f"unknown journal entry {op!r}")


def _dropped(job: Job, event: Event) -> None:
    """A follower's job ends silently (the leader answers the client)."""


def job_record(job: Job) -> dict[str, Any]:
    """What a follower needs to run `job` exactly as the leader does (the journal's `job`)."""
    s = job.sampling
    sampling = {**s.__dict__, "stop": list(s.stop),
                "logit_bias": None if s.logit_bias is None else list(s.logit_bias.items()),
                "constraint": None if s.constraint is None else {
                    **s.constraint.__dict__, "tools": [list(t) for t in s.constraint.tools]}}
    return {"op": "job", "id": job.id, "tokens": job.prompt.tokens,
            "boundaries": job.prompt.boundaries, "max_tokens": job.max_tokens,
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
    return Job(Prompt(list(record["tokens"]), list(record["boundaries"])), sampling,
               int(record["max_tokens"]), record["logprobs"], lambda event: None,
               asyncio.Queue(), namespace=str(record["namespace"]), id=int(record["id"]))
