"""Speculative decoding: drafts and their verification, exact on every cache kind.

Owns: the `Drafter` protocol (`drafter.py`) and the three drafters that implement it (prompt
lookup over the request's own context, `lookup.py`; a draft model, `draftmodel.py`; the served
model's multi-token-prediction head, `mtpdraft.py`), how much to draft and when it pays
(`draft.py`: `Pace`, `PassCosts`), how wide a decode batch's verify pass is and whether it
drafts at all (`company.py`: `width`, `BatchPace`), how the Engine speculates (`config.py`),
one run's speculation and its verify pass (`speculate.py`), and what it needs of a run
(`row.py`: the `Row` protocol, the greedy draw of many rows). Imports `engine/inpass` only:
the run and the batch import it.
"""
