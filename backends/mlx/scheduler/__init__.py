"""The generation loop: the one thread every mlx call of the worker runs on, the jobs it runs,
and which forward pass runs next.

Owns: `Job`s and their events (`jobs.py`), the loop and its inbox (`generator.py`), the pure
admission and pass policy (`schedule.py`, over its `Slot`s: `slots.py`; admission by memory:
`room.py`; what a job's cache weighs: `sizing.py`), the loop that runs it (`loop.py`), one job
under way and its typed steps (`active.py`, `steps.py`), text and log-probabilities out of
sampled tokens (`output.py`), the idle disk writes and the status snapshot (their own owners:
`writes.py`, `status.py`), a group's journal, typed (`journal.py`: one frozen record per
decision a follower replays, one `encode`/`decode` pair; the group room carries the JSON), and
a follower's copy of the loop (`replay.py`: an exhaustive `match` over those records). It
drives the engine; the engine never calls back into it.
"""
