"""The engine: one model and its prompt cache. Restore the longest cached prefix, prefill the
rest in passes with checkpoints, decode alone or with company, commit what the live state
holds.

Owns, at its top: the Engine (`engine.py`: a turn's `begin`, its passes `steps_of`, its `end`;
restores in `restoring.py`, checkpoints and commits in `checkpointing.py`, both mixins of it),
one request's run (`run.py`: its prefill passes cut or captured at checkpoint marks, its decode;
the typed steps and what each goes in with, `pacing.py`), the start-up probes (`probe.py`), the
counts and metrics (`counts.py`, `stats.py`), the RAM/disk glue (`tierglue.py`), what a reply
can restore (`restorable.py`), the settings it reads (`config.py`) and loading a model into an
Engine (`loading.py`). Its rooms, each importing only those before it:

- `inpass/`: states inside one forward pass (the in-pass tap and what it captured);
- `spec/`: speculative decoding (the `Drafter` protocol and its three drafters, pacing, the
  verify pass, the width of a batch's verify pass);
- `live/`: one request's live state, as the batch and speculation see it;
- `batch/`: decode with company (the batch executor, its members, shared prefill passes);
- `transfer/`: state moves between workers (bundles and their checks), on the Engine.

Every value a rank of a group computes alone goes through the lockstep (`group.lockstep`);
the engine never asks which rank it is. Imports `cache`, `disk`, `group.lockstep`, `model`,
`chat`; never the scheduler.
"""
