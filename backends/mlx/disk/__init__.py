"""The disk tier: block and record files under a byte budget, their format and index, the
writer thread, content addresses of prefixes, and the policy of what goes to disk when and
what is worth loading back (`tiers.py`).

Owns: the files of one tier directory (never through a link: `fs.py`) and its index. Imports
`cache` only; the engine drives it (`engine.tierglue`).
"""
