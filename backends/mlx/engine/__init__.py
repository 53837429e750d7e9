"""The engine: one model and its prompt cache. Restore the longest cached prefix, prefill the rest
in passes with checkpoints, decode, commit what the live state holds.

Owns: the Engine (`engine.py`, with its checkpoints and commits in `checkpointing.py`), one
request's live state and its forward passes (`run.py`, `tap.py` for in-pass checkpoints), decode
steps of several requests in one pass (`batch.py`; its caches put together by `stacking.py`, KV
rows with gaps `gapped.py`, each row back to its own position `rows.py`), speculative decoding
(`speculate.py`; drafts and their pacing `draft.py`, `drafter.py`, `mtpdraft.py`; states
captured in a verify pass `captured.py`), the start-up probes (`probe.py`), the counts and
metrics (`counts.py`, `stats.py`), the RAM/disk glue (`tierglue.py`), state moves between
workers (`bundle.py`), what a reply can restore (`restorable.py`), and loading a model into an
Engine (`loading.py`). Every value a rank of a group computes alone goes through the lockstep
(`group.lockstep`); the engine never asks which rank it is. Imports `cache`, `disk`,
`group.lockstep`, `model`, `chat`; never the scheduler.
"""
