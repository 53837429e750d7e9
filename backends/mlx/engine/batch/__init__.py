"""Decode with company: several requests' rows in one pass.

Owns: the batch executor (`executor.py`: one pass of every member's pending token, or of
their drafts up to the width the pass can afford), who is in the batch and their caches in
and out (`members.py`), how rows' caches are stacked (`stacking.py`), full-attention KV rows
with gaps (`gapped.py`), each row going back to its own position after a batched verify
(`rows.py`), several short prompts prefilled in one pass (`prefill.py`), and what every pass
carried (`passes.py`). Imports `engine/live`, `engine/spec` and `engine/inpass`.
"""
