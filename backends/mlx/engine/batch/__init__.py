"""Decode with company: several requests' decode steps, and their drafts, in one pass.

Owns: the batch executor (`executor.py`: who is in the batch, one pass of their pending tokens
or of their drafts), how rows' caches are stacked (`stacking.py`), full-attention KV rows with
gaps (`gapped.py`), each row going back to its own position after a batched verify
(`rows.py`), and what every pass carried (`passes.py`). Imports `engine/live`, `engine/spec`
and `engine/inpass`.
"""
