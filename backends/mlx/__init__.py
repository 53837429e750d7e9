"""The prefixd mlx worker: an mlx-lm model server process whose prompt cache checkpoints
hybrid model state (recurrent Gated-DeltaNet/Mamba state, sliding-window KV).

Its rooms, from the top (each imports only rooms below it; `tests/test_layers.py` checks):

    server     the HTTP face: endpoints, responses, streams, state moves
    scheduler  the generation loop: jobs, admission, one forward pass at a time
    grammar    structured output: the grammar and its token mask
    engine     one model and its prompt cache: restore, prefill, decode, commit
    disk       the disk tier: files, index, writer, what goes to disk when
    cache      the RAM store, cache-class snapshots, checkpoint placement
    group      the lockstep seam of a multi-process worker
    model      weights into mlx: provisioning, GGUF, BLAS, tiny test models
    chat       requests and replies as text: template, tokens, OpenAI shapes

`settings.py` (read by the proxy too) and `__main__.py` (the process) sit beside them. Runs in
its own process; only this package imports mlx.
"""
