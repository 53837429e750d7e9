"""prefixd's backends: the `Backend` protocol and its kinds.

Owns: talking to model servers (`openai`: any OpenAI-compatible URL; `mlx`: a managed
prefixd worker subprocess), their process state and health, and — in `backends.mlx` — the
worker itself with its checkpoint store and model provisioning.
Must not know about lanes, mutation reports or canonicalization.
"""
