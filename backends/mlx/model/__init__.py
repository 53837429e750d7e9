"""Getting weights into mlx: resolving and converting a model spec (`provision.py`, `gguf.py`),
the system BLAS (`blas.py`), the machine's memory (`memory.py`), a checkpoint's
multi-token-prediction head (`mtp.py`), what a drafter must be to draft for a model
(`checks.py`: finite weights, the same tokenizer), and the tiny random-weight models tests and
benches build (`tiny.py`, `tinytok.py`).

Owns: the converted-model cache folder. Imports no other room.
"""
