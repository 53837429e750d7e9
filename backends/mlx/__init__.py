"""The prefixd mlx worker: an mlx-lm model server process whose prompt cache checkpoints
hybrid model state (recurrent Gated-DeltaNet/Mamba state, sliding-window KV).

Owns: model loading and provisioning, the chat template, generation, the checkpoint store
and its byte budget, the tiny-model factory used by tests and benchmarks. Runs in its own
process; only this package imports mlx.
"""
