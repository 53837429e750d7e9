"""The scheduler's pure policy (no threads, no mlx): which waiting job is admitted and which
admitted jobs run in the next forward pass, and how many tokens.

Owns: the `Schedule` (`schedule.py`: admission, picking, aging, pausing, the one place a
prefill pass is sized) and the pass it plans (`plan.py`: one job's step, the decode rows of
the jobs decoding and those whose prompt's last token waits, or several short prompts
prefilled in one pass), the jobs waiting for a prefix another job computes (`sharing.py`),
admission by memory (`room.py`), the admitted job as the policy sees it (`slots.py`) and the
typed step protocol between a decision and its pass (`steps.py`). Imports the scheduler's
`jobs` and the engine's typed steps only.
"""
