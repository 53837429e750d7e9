"""The journal of a group worker, typed: every decision its leader takes that a follower
replays, one frozen record each, and their one wire form.

Owns: the records (`Record`: a job started, a job's step on its `Decision`, a batched decode
step, a prefill pass of several prompts, a prefix published from a live run, the disk writes
due, persist, exit), `encode` (record -> a JSON-able dict tagged by `op`) and `decode`
(back; an unknown tag or a record with fields missing or extra is a `JournalError`). The
group's transport (`group/leader.py`, `group/follower.py`) carries the dicts as they are and
imports nothing of this: it only numbers them (`seq`, dropped here), and writes the two
entries that are its own, `persist` and `exit`, in the same form (`PersistEntry`,
`ExitEntry`). The scheduler journals (`active.py`, `generator.py`, `writes.py`); a follower
replays (`replay.py`, whose `match` over `Record` mypy checks is exhaustive).

A `Decision` and a `Sampling` are journaled field by field, so a field added to either is
carried (and a follower reading a record without it fails instead of taking a default).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields
from typing import Any, ClassVar, assert_never

from prefixd.api.structured import Constraint
from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.group.lockstep import LockstepError
from prefixd.backends.mlx.scheduler.jobs import Job
from prefixd.backends.mlx.scheduler.policy.steps import Decision

__all__ = ["BatchEntry", "ExitEntry", "JobEntry", "JournalError", "PersistEntry",
           "PrefillEntry",
           "PublishEntry", "Record", "StepEntry", "WriteEntry", "decode", "encode"]


class JournalError(LockstepError):
    """A journal entry this rank cannot read (the group's ranks have parted)."""


@dataclass(frozen=True)
class JobEntry:
    """A job started: what a follower needs to run it exactly as the leader does."""

    OP: ClassVar[str] = "job"
    id: int
    tokens: list[int]
    boundaries: list[int]
    thinking: bool
    max_tokens: int
    logprobs: int | None
    namespace: str
    sampling: Sampling

    @classmethod
    def of(cls, job: Job) -> JobEntry:
        p = job.prompt
        return cls(job.id, p.tokens, p.boundaries, p.thinking, job.max_tokens, job.logprobs,
                   job.namespace, job.sampling)

    def job(self) -> Job:
        """The job a follower runs (its events go nowhere)."""
        return Job(Prompt(list(self.tokens), list(self.boundaries), thinking=self.thinking),
                   self.sampling, self.max_tokens, self.logprobs, lambda event: None,
                   asyncio.Queue(), namespace=self.namespace, id=self.id)


@dataclass(frozen=True)
class StepEntry:
    """One step of job `job` (one forward pass, or its part up to a pause) on `decision`."""

    OP: ClassVar[str] = "step"
    job: int
    decision: Decision


@dataclass(frozen=True)
class BatchEntry:
    """One decode step of every job in `jobs` in one pass; `stop`: each one's
    `Decision.stop`."""

    OP: ClassVar[str] = "batch"
    jobs: list[int]
    stop: list[bool]


@dataclass(frozen=True)
class PrefillEntry:
    """The prompts of the jobs in `jobs` (started by it where not yet) that restored nothing,
    all but their last token, in one pass; `stop`: each one's `Decision.stop`."""

    OP: ClassVar[str] = "prefill"
    jobs: list[int]
    stop: list[bool]


@dataclass(frozen=True)
class PublishEntry:
    """Job `job`'s prompt state at `at` stored from its live run (jobs wait for it)."""

    OP: ClassVar[str] = "publish"
    job: int
    at: int


@dataclass(frozen=True)
class WriteEntry:
    """The store positions of the entries handed to the disk writer."""

    OP: ClassVar[str] = "write"
    entries: list[int]


@dataclass(frozen=True)
class PersistEntry:
    """At shutdown: write what the disk tier lacks, wait at most `timeout` s, answer whether
    it is all written (the group's `Leader.persist` sends it)."""

    OP: ClassVar[str] = "persist"
    timeout: float


@dataclass(frozen=True)
class ExitEntry:
    """The leader ends the group (`group/start.py` sends it, unnumbered)."""

    OP: ClassVar[str] = "exit"


Record = (JobEntry | StepEntry | BatchEntry | PrefillEntry | PublishEntry | WriteEntry
          | PersistEntry | ExitEntry)
RECORDS: tuple[type[Record], ...] = (JobEntry, StepEntry, BatchEntry, PrefillEntry,
                                     PublishEntry, WriteEntry, PersistEntry, ExitEntry)
_BY_OP: dict[str, type[Record]] = {cls.OP: cls for cls in RECORDS}


def encode(record: Record) -> dict[str, Any]:
    """`record` as the journal carries it: a JSON-able dict, tagged by its `op`."""
    body: dict[str, Any]
    match record:
        case JobEntry():
            body = {f.name: getattr(record, f.name) for f in fields(record)}
            body["sampling"] = _sampling_out(record.sampling)
        case StepEntry(job=job, decision=decision):
            body = {"job": job, "decision": _fields_out(decision)}
        case (BatchEntry() | PrefillEntry() | PublishEntry() | WriteEntry() | PersistEntry()
              | ExitEntry()):
            body = {f.name: getattr(record, f.name) for f in fields(record)}
        case _:
            assert_never(record)
    return {"op": record.OP, **body}


def decode(entry: dict[str, Any]) -> Record:
    """A journal entry (as `encode` made it, with the transport's `seq` or without) back into
    its record; `JournalError` for an unknown tag or fields missing or extra."""
    raw = {k: v for k, v in entry.items() if k != "seq"}
    op = raw.pop("op", None)
    cls = _BY_OP.get(op) if isinstance(op, str) else None
    if cls is None:
        raise JournalError(f"unknown journal entry {op!r} (known: {', '.join(_BY_OP)})")
    _exact(raw, cls, f"journal entry {op!r}")
    try:
        if cls is JobEntry:
            return JobEntry(**{**raw, "tokens": list(raw["tokens"]),
                               "boundaries": list(raw["boundaries"]),
                               "sampling": _sampling_in(raw["sampling"])})
        if cls is StepEntry:
            decision = raw["decision"]
            _exact(decision, Decision, "a step's decision")
            return StepEntry(int(raw["job"]), Decision(**decision))
        return cls(**raw)
    except (TypeError, ValueError, AttributeError) as e:
        raise JournalError(f"journal entry {op!r} does not read: {e}") from e


def _exact(raw: Any, cls: Any, what: str) -> None:
    if not isinstance(raw, dict):
        raise JournalError(f"{what} is not an object: {raw!r}")
    want = {f.name for f in fields(cls)}
    if set(raw) != want:
        missing, extra = sorted(want - set(raw)), sorted(set(raw) - want)
        raise JournalError(f"{what}: fields missing {missing}, unknown {extra}")


def _fields_out(value: Any) -> dict[str, Any]:
    return {f.name: getattr(value, f.name) for f in fields(value)}


def _sampling_out(s: Sampling) -> dict[str, Any]:
    c = s.constraint
    return {**_fields_out(s), "stop": list(s.stop),
            "logit_bias": None if s.logit_bias is None else list(s.logit_bias.items()),
            "constraint": None if c is None else {
                **_fields_out(c), "tools": [list(t) for t in c.tools]}}


def _sampling_in(raw: Any) -> Sampling:
    _exact(raw, Sampling, "a job's sampling")
    bias, c = raw["logit_bias"], raw["constraint"]
    if c is not None:
        _exact(c, Constraint, "a job's constraint")
        c = Constraint(**{**c, "tools": tuple((name, params) for name, params in c["tools"])})
    return Sampling(**{**raw, "stop": tuple(raw["stop"]), "constraint": c,
                       "logit_bias": None if bias is None else {int(k): v for k, v in bias}})
