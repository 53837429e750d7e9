"""Process supervision: a child process prefixd starts, watches, restarts and stops, and the
child's side of it (exiting with its parent).

Owns: the child process (`process.py`: its command line and environment, spawning it in its
own process group, its output in the log, a stop that cannot hang), its states and the one
setter (`states.py`), what its Backend reads and reports (`face.py`), the one task that drives
it (`supervisor.py`), the restart and unload decisions (`lifecycle.py`), whether it answers
(`health.py`), and exiting with the parent (`parent.py`, which a prefixd worker and the proxy
under `prefixd demo` call). The kinds that run a child through it — a prefixd worker
(`backends/managed.py`) and llama-server (`backends/llama/managed.py`) — sit outside it.
Must not know what the child serves: no request shapes, no routing, no mlx (the worker's exit
codes and token variable are restated in `process.py`).
"""
