"""The generation loop: the one thread every mlx call of the worker runs on, the jobs it runs,
and which forward pass runs next.

Owns: `Job`s and their events (`jobs.py`), the loop and its inbox (`generator.py`), the loop
that runs each planned pass (`loop.py`) over the pure policy (`policy/`: admission, the pick,
the pass plan, a pass's size, admission by memory, shared prefixes), one job under way and its
typed steps (`active.py`: a step alone, a decode pass of several, a prefill pass of several),
what a job's cache weighs (`sizing.py`), text and log-probabilities out of sampled tokens
(`output.py`), the idle disk writes and the status snapshot (their own owners: `writes.py`,
`status.py`), and a group's journal and a follower's replay of it (`journal.py`,
`replay.py`). It drives the engine; the engine never calls back into it.
"""
