"""The lockstep seam's group forms below the worker (`backends/mlx/group/`): agreed values are
one sequence-numbered all-reduce each, so two ranks at different collectives fail instead of
taking each other's values; a follower reads the journal in sequence, answers by number and
sends heartbeats with its status from a thread of its own. Real MLX ring groups of two
processes on loopback; a loopback TCP connection for the control channel."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from prefixd.backends.mlx.group.control import Channel
from prefixd.backends.mlx.group.follower import Follower
from prefixd.backends.mlx.group.lockstep import Lockstep, LockstepError
from prefixd.backends.mlx.group.ring import port

RANK = r'''
import json, sys
from prefixd.backends.mlx.group.lockstep import Collectives, LockstepError
from prefixd.backends.mlx.group.ring import attempt
ring, rank = sys.argv[1], int(sys.argv[2])
group, error = attempt(ring, rank)
assert error is None, error
step = Collectives(group)
out = {"max": step.max(10 + rank), "min": step.min(10 + rank), "all": step.all(rank == 0),
       "any": step.any(rank == 1), "leader": step.leader(7 if rank == 0 else 3),
       "big": step.max(2**40 * (rank + 1)), "negative": step.min(-5 * rank)}
try:    # the ranks part: rank 0 asks for a max, rank 1 for a min (one collective each)
    out["parted"] = step.max(1) if rank == 0 else step.min(1)
except LockstepError as e:
    out["parted"] = str(e)
print(json.dumps(out), flush=True)
'''


def _ring_of_two(tmp_path: Path) -> list[dict[str, Any]]:
    ring = json.dumps([[f"127.0.0.1:{port('127.0.0.1')}"] for _ in range(2)])
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    procs = [subprocess.Popen([sys.executable, str(script), ring, str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr[-2000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


@pytest.mark.slow
def test_agreed_values_and_ranks_at_different_collectives_fail(tmp_path: Path) -> None:
    zero, one = _ring_of_two(tmp_path)
    for out in (zero, one):
        assert (out["max"], out["min"], out["all"], out["any"], out["leader"]) == \
            (11, 10, False, True, 7)
        assert (out["big"], out["negative"]) == (2**41, -5)
        assert isinstance(out["parted"], str) and "collective 8" in out["parted"], out


def test_one_process_agrees_with_itself() -> None:
    solo = Lockstep()
    assert (solo.max(3), solo.min(3), solo.all(False), solo.any(True), solo.leader(9)) == \
        (3, 3, False, True, 9)
    solo.local_failure()                 # one process recovers alone: it returns
    assert solo.failed("x") is None and solo.persist(lambda t: True, 1.0) is True


class _Group:
    """The MLX group at the boundary (the follower's journal needs no collective)."""

    def rank(self) -> int:
        return 1

    def size(self) -> int:
        return 2


def _follower(watchdog_s: float = 50.0) -> tuple[Follower, Channel]:
    """A follower and the leader's end of its control channel (TCP on loopback)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        mine = socket.create_connection(listener.getsockname(), timeout=10)
        leaders, _ = listener.accept()
    return Follower(_Group(), Channel(mine), watchdog_s), Channel(leaders)


def test_a_follower_reads_the_journal_in_sequence_and_answers_by_number() -> None:
    follower, leader = _follower()
    try:
        leader.send({"op": "job", "seq": 1})
        leader.send({"op": "persist", "seq": 2})
        assert follower.next()["op"] == "job"
        assert follower.next()["op"] == "persist"
        follower.answer({"done": True})
        assert leader.recv(timeout=10) == {"done": True, "seq": 2}
        leader.send({"op": "step", "seq": 4})            # 3 is missing: the ranks parted
        with pytest.raises(LockstepError, match="entry 4 after 2"):
            follower.next()
        leader.send({"op": "step", "seq": 4})            # a repeat is no better
        with pytest.raises(LockstepError):
            follower.next()
        with pytest.raises(LockstepError):
            follower.failed("boom")                      # a failed step ends this rank
    finally:
        follower.close()
        leader.close()


def test_a_follower_beats_with_its_status_from_its_own_thread() -> None:
    follower, leader = _follower(watchdog_s=1.0)       # a beat every 0.2 s
    follower.status = lambda: {"jobs": 2, "cache_bytes": 7}
    try:
        beats = []
        deadline = time.monotonic() + 30
        while len(beats) < 3:
            assert time.monotonic() < deadline
            beats.append(leader.recv(timeout=30))       # while nothing reads the journal
        assert all(b["op"] == "beat" and b["jobs"] == 2 and b["cache_bytes"] == 7
                   for b in beats)
        follower.status = lambda: 1 / 0                  # a failing status still beats
        while (beat := leader.recv(timeout=30)) != {"op": "beat", "done": 0}:
            assert time.monotonic() < deadline and beat["jobs"] == 2   # one sent before
    finally:
        follower.close()
        leader.close()
