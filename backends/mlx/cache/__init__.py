"""The prompt cache's parts in RAM: the checkpoint store and its byte budget (`store.py`, pure
policy over token lists), what each mlx-lm cache class allows and how to snapshot, trim and
restore it (`snapshot.py`), and where checkpoints go (`placement.py`, pure).

Owns: the store's entries and checkpoints (the engine holds the one store). The lowest room:
imports no other.
"""
