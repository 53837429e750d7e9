"""A worker that spans processes or machines: the lockstep seam every rank's generation loop
holds (`lockstep.py`: one process, leader and follower forms), the control channel and its
authenticated join (`control.py`), the MLX ring (`ring.py`), and the leader's start and stop
of its followers (`leader.py`).

Owns: the group's membership, its sequence numbers, its watchdog and its end. Imports no other
room: the engine and the scheduler call it. The journal it carries is plain JSON: its typed
records and their one encoding are the scheduler's (`scheduler/journal.py`).
"""
