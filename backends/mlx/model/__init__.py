"""Getting weights into mlx: resolving and converting a model spec (`provision.py`, `gguf.py`),
the system BLAS (`blas.py`), the machine's memory (`memory.py`), a checkpoint's
multi-token-prediction head (`mtp.py`), and the tiny random-weight models tests and benches
build (`tiny.py`, `tinytok.py`).

Owns: the converted-model cache folder. Imports no other room.
"""
