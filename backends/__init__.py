"""prefixd's backends: the `Backend` protocol and its kinds.

Owns: talking to model servers (`openai`: any OpenAI-compatible URL; `managed`: a managed
prefixd worker subprocess; `llama`: a managed llama-server), their process state and health
(`supervision`: the child processes prefixd starts, watches, restarts and stops), and — in
`backends.mlx` — the worker itself with its checkpoint store and model provisioning.
Must not know about lanes, mutation reports or canonicalization.
"""
