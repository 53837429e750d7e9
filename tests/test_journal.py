"""A group worker's journal, typed (`backends/mlx/scheduler/journal.py`): every record type
survives the wire (encode -> JSON -> decode) with non-default values, a new record type without
a case here fails, unknown or misshapen entries are refused by name, a follower's `Replay`
takes every record type, and a follower steps on the leader's very `Decision` (pausable and
share included). No model: the jobs under way are `Active`s whose engine step is stubbed."""

from __future__ import annotations

import ast
import json
import re
import threading
from dataclasses import fields, is_dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args

import pytest

from prefixd.api.structured import Constraint
from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.engine.live.fed import Fed
from prefixd.backends.mlx.engine.pacing import Plan
from prefixd.backends.mlx.group.leader import Leader
from prefixd.backends.mlx.group.lockstep import Lockstep
from prefixd.backends.mlx.group.start import Start
from prefixd.backends.mlx.scheduler import journal
from prefixd.backends.mlx.scheduler.active import Active
from prefixd.backends.mlx.scheduler.jobs import Job
from prefixd.backends.mlx.scheduler.journal import (
    BatchEntry,
    ExitEntry,
    JobEntry,
    JournalError,
    PersistEntry,
    PrefillEntry,
    PublishEntry,
    Record,
    StepEntry,
    WriteEntry,
    decode,
    encode,
)
from prefixd.backends.mlx.scheduler.policy.steps import Decision, Decoded, Finished, Step
from prefixd.backends.mlx.scheduler.replay import Replay

ROOT = Path(__file__).resolve().parent.parent

SAMPLING = Sampling(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1,
                    stop=("STOP", "\n\n"), seed=42, presence_penalty=0.2,
                    frequency_penalty=0.3, repetition_penalty=1.1,
                    logit_bias={3: -1.5, 9: 2.0},
                    constraint=Constraint(schema={"type": "object"},
                                          tools=(("f", {"type": "object"}),),
                                          required=True, parallel=False))
DECISION = Decision(tokens=96, stop=True, share=40, pausable=False)

# one case per record type, every field away from its default
CASES: list[Record] = [
    JobEntry(id=3, tokens=[1, 2, 3, 4], boundaries=[2], thinking=True, max_tokens=12,
             logprobs=2, namespace="tenant", sampling=SAMPLING),
    StepEntry(job=3, decision=DECISION),
    BatchEntry(jobs=[3, 5], stop=[False, True]),
    PrefillEntry(jobs=[3, 5, 6], stop=[False, True, False]),
    PublishEntry(job=3, at=128),
    WriteEntry(entries=[0, 4, 7]),
    PersistEntry(timeout=2.5),
    ExitEntry(),
]


def wire(entry: dict[str, Any]) -> dict[str, Any]:
    """What the group's channel does to an entry: JSON, numbered."""
    return {**json.loads(json.dumps(entry)), "seq": 17}


@pytest.mark.parametrize("record", CASES, ids=lambda r: type(r).__name__)
def test_every_record_survives_the_wire_with_non_default_values(record: Record) -> None:
    assert decode(wire(encode(record))) == record
    assert encode(record)["op"] == type(record).OP


def test_every_record_type_has_a_round_trip_case() -> None:
    """The module's record classes are `Record`'s members, and each has its case above."""
    defined = {v for v in vars(journal).values()
               if isinstance(v, type) and is_dataclass(v) and hasattr(v, "OP")}
    assert defined == set(get_args(Record)) == set(journal.RECORDS)
    assert {type(r) for r in CASES} == defined
    assert len({cls.OP for cls in defined}) == len(defined)


def _non_default(value: Any, default: Any) -> list[str]:
    """The fields of `value` equal to those of `default` (a new field needs a case)."""
    return [f.name for f in fields(value) if getattr(value, f.name) == getattr(default, f.name)]


def test_the_cases_set_every_field_of_a_decision_and_a_sampling() -> None:
    assert _non_default(DECISION, Decision(0, False)) == []
    assert _non_default(SAMPLING, Sampling()) == []
    assert SAMPLING.constraint is not None
    assert _non_default(SAMPLING.constraint, Constraint()) == []


def test_a_job_entry_gives_the_follower_the_leaders_job() -> None:
    job = Job(Prompt([5, 6, 7], [1, 2], thinking=True), SAMPLING, 9, 3, lambda e: None,
              None, namespace="ns", id=11)   # type: ignore[arg-type]
    again = decode(wire(encode(JobEntry.of(job))))
    assert isinstance(again, JobEntry)
    twin = again.job()
    assert (twin.prompt.tokens, twin.prompt.boundaries, twin.prompt.thinking) == \
        ([5, 6, 7], [1, 2], True)
    assert (twin.sampling, twin.max_tokens, twin.logprobs, twin.namespace, twin.id) == \
        (SAMPLING, 9, 3, "ns", 11)


@pytest.mark.parametrize("entry, why", [
    ({"op": "plan", "jobs": [1]}, "unknown journal entry 'plan'"),
    ({"jobs": [1]}, "unknown journal entry None"),
    ({"op": "publish", "job": 1}, "fields missing ['at']"),
    ({"op": "write", "entries": [1], "extra": 0}, "unknown ['extra']"),
    ({"op": "step", "job": 1, "decision": {"tokens": 4, "stop": False, "share": 0}},
     "a step's decision: fields missing ['pausable']"),
    ({"op": "step", "job": 1, "tokens": 4, "stop": False, "share": 0},
     "fields missing ['decision']"),
])
def test_decode_refuses_unknown_and_misshapen_entries_by_name(entry: dict[str, Any],
                                                              why: str) -> None:
    with pytest.raises(JournalError, match=re.escape(why)):
        decode(entry)


# --- replay, with no model ---------------------------------------------------------------------
class Probe(Active):
    """An `Active` whose engine step is stubbed: it records what each step ran on."""

    ran: list[tuple[int, bool, int, bool]]

    def advance(self, sent: Plan | Fed | None = None) -> Step:
        # a step of its own goes in with its plan; a batch's step with none (the last stands)
        p = self.plan = sent if isinstance(sent, Plan) else getattr(self, "plan", Plan(0))
        self.ran = [*getattr(self, "ran", []), (p.tokens, self.stopping, p.share, p.pausable)]
        return Finished("cancelled", 0, 0) if self.stopping else Decoded(len(self.ran))

    def publish(self, at: int) -> int | None:
        self.published = at
        return at

    def begin(self) -> None:     # nothing to restore
        self.begun = True


class Rank(Lockstep):
    """A rank's lockstep that keeps what it journals (as the channel carries it) and what
    it answers."""

    untimed = True

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.answers: list[dict[str, Any]] = []

    def journal(self, record: dict[str, Any]) -> None:
        self.sent.append(wire(record))

    def answer(self, payload: dict[str, Any]) -> None:
        self.answers.append(payload)


class Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def write(self, positions: list[int]) -> int:
        self.calls.append(("write", positions))
        return len(positions)

    def persist(self) -> None:
        self.calls.append(("persist", None))

    def close(self, timeout: float) -> bool:
        self.calls.append(("close", timeout))
        return True


class Follower(Replay):
    def __init__(self) -> None:
        self.engine, self.rank = Engine(), Rank()
        super().__init__(SimpleNamespace(engine=self.engine), self.rank)  # type: ignore[arg-type]

    def start(self, job: Job) -> Active:
        return Probe(self.loaded, self.grammars, job, self.lockstep)


def _job(follower: Follower, i: int) -> Probe:
    active = follower.jobs[i]
    assert isinstance(active, Probe)
    return active


def test_a_follower_replays_every_record_type() -> None:
    follower, seen = Follower(), set()
    for record in [JobEntry(3, [1, 2], [], False, 4, None, "", Sampling()),
                   JobEntry(5, [1, 3], [], False, 4, None, "", Sampling()),
                   StepEntry(3, Decision(8, False, 2, False)),
                   StepEntry(5, Decision(8, False)),
                   JobEntry(6, [1, 4], [], False, 4, None, "", Sampling()),
                   PrefillEntry([6], [False]),              # 6's first step
                   BatchEntry([3, 5, 6], [False, True, True]),   # 5 and 6 stop: they end
                   PublishEntry(3, 2), WriteEntry([1, 4]), PersistEntry(1.5)]:
        assert follower.apply(decode(wire(encode(record)))) is True
        seen.add(type(record))
    assert set(follower.jobs) == {3}
    assert _job(follower, 3).ran == [(8, False, 2, False), (8, False, 2, False)]
    assert _job(follower, 3).published == 2
    assert follower.engine.calls == [("write", [1, 4]), ("persist", None), ("close", 1.5)]
    assert follower.rank.answers == [{"done": True}]
    assert follower.apply(decode(wire(encode(ExitEntry())))) is False
    assert seen | {ExitEntry} == set(journal.RECORDS)


def test_a_follower_steps_on_the_leaders_decision_pausable_and_share_included() -> None:
    """The drift of issue 51: the leader's `Decision.pausable` was neither journaled nor
    replayed, so a follower's pass could pause where the leader's could not."""
    leader = Rank()
    job = JobEntry(1, [1, 2, 3], [], False, 4, None, "", Sampling()).job()
    active = Probe(None, None, job, leader)   # type: ignore[arg-type]
    leader.journal(encode(JobEntry.of(job)))
    for decision in (Decision(64, False, share=32, pausable=False), Decision(16, False)):
        active.step(decision)
    follower = Follower()
    for entry in leader.sent:
        follower.apply(decode(entry))
    assert _job(follower, 1).ran == active.ran == [(64, False, 32, False), (16, False, 0, True)]


# --- the group's own entries and the journal's callers -----------------------------------------
class Channel:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        self.sent.append(json.loads(json.dumps(message)))

    send_now = send

    def close(self) -> None:
        pass


def test_the_entries_the_group_writes_itself_decode() -> None:
    """`persist` (the leader's) and `exit` (its start's stop) are the transport's; they read as
    `PersistEntry` and `ExitEntry`."""
    leader, channel = Leader.__new__(Leader), Channel()
    leader.channels, leader.sent, leader._sending = [channel], 0, threading.Lock()
    leader._answers = lambda seq, timeout: [{"done": True}]   # type: ignore[method-assign]
    assert leader.persist(lambda timeout: True, 2.5)
    start = Start.__new__(Start)
    start.channels, start.children = [channel], []            # type: ignore[list-item]
    start.stop()
    assert [decode(m) for m in channel.sent] == [PersistEntry(2.5), ExitEntry()]


def test_every_journal_call_sends_an_encoded_record() -> None:
    """No dict literal journal entries: each `.journal(...)` outside the transport (and this
    file) is `journal(encode(<Record>(...)))`."""
    calls = []
    for path in (ROOT / "backends").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "journal"):
                calls.append((path.relative_to(ROOT), node))
    assert len(calls) >= 5
    bad = [f"{p}:{n.lineno}" for p, n in calls if not (
        len(n.args) == 1 and isinstance(n.args[0], ast.Call)
        and isinstance(n.args[0].func, ast.Name) and n.args[0].func.id == "encode")]
    assert bad == []
